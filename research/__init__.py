"""Research tools, one command each (`python -m research.NAME`): the counterfactual study, the grid, calibration, plots."""
