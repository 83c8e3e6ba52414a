"""The sampling engine beneath rollout.py, and the memory plan that sizes it."""
