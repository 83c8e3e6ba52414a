"""What turns a completion into a grade beneath reward.py: the LaTeX parser, the code sandbox, reward functions."""
