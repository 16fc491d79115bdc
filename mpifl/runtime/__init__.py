"""The round loop on every rank: launch, plan walking, faults, placement of data, results and checkpoints."""
