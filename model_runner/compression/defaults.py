"""The two constants of the static horizon (paper eqs. 2-3) that horizons and plans default to;
torch-free, so that plans and their byte accounting import without torch."""

DEFAULT_GATE_INPUT = -0.3  # representative gate input a
DEFAULT_EPS = 1e-3  # decay floor: a unit's horizon is where its decay falls to eps
