"""Decay-aware state compression: horizons, selection plans, checkpoint formats, placement."""
