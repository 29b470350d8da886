"""Reproduction: the published numbers, the constants fitted to them, the models that explain them (B300,
DP waves, measured H200 ceilings) and every table the notebooks print and the figures draw. Imports plan,
models and repro only; reads committed data under ``figures/data/``."""
