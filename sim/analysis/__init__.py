"""Analysis on top of simulations: frames, plots, gates, sweeps."""
