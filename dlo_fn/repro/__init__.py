"""Reproduction: the published numbers, the constants fitted to them, the models that explain them (B300,
DP waves, measured H200 ceilings) and every table the notebooks print. Reads plan and committed data only."""
