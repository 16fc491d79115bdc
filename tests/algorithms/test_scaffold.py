"""SCAFFOLD: twice FedAvg's bytes (its client and server steps: test_references.py)."""


from mpifl.report import logical_totals


def test_control_variates_double_the_bytes(run_algo):
    fedavg, scaffold = run_algo("fedavg"), run_algo("scaffold")
    base, mine = logical_totals(fedavg)["train"], logical_totals(scaffold)["train"]
    assert mine["down"] == {"model": base["down"]["model"], "control": base["down"]["model"]}
    assert mine["up"] == {"delta": base["up"]["delta"], "control_delta": base["up"]["delta"]}
