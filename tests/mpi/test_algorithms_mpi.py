"""Every algorithm, and every option that changes how a round moves, on the world communicator equals the
same run in one process (rank 0, COMM_SELF)."""

import pytest

from mpifl.registry import parse_config
from tests.algorithms.test_norm_eval import BN
from tests.conftest import _merge, assert_same, deterministic, run_engine
from tests.test_checkpoint import CONFIGS

COVERED_ELSEWHERE = {"fedals", "feddeper", "pefll", "pfedhn"}  # their own pytest-mpi files


VARIANTS = {  # options that change which clients take part in what, or how batches are made
    "pfedme_personalize_all": _merge(CONFIGS["pfedme"], {"clients_per_round": 2, "pfedme": {"personalize": "all"}}),
    "local_mode_all": _merge(CONFIGS["local"], {"clients_per_round": 4, "data": {"unseen_fraction": 0.34},
                                                "local": {"mode": "all", "epochs": 2}}),
    "pfedhn_averaged": _merge(CONFIGS["pfedhn"], {"pfedhn": {"server_steps": "averaged"}}),
    "fedals_batchnorm_chunked": _merge(BN, {"algorithm": "fedals", "eval_chunk": 2, "clients_per_round": 3,
                                            "fedals": {"alpha": 2, "tau": 2, "scaffold": True}}),
    "fedavg_fresh_batches_augmented": _merge(BN, {"algorithm": "fedavg", "model": {"name": "cnn", "channels": [4]},
                                                  "client": {"batch_sampling": "fresh", "augment": "crop_flip"}}),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_world_run_of_each_option_equals_single_process_run(variant, tmp_path_factory):
    cfg = parse_config(_merge(VARIANTS[variant], {"rounds": 2, "eval_every": 1}))
    compare_world_with_alone(cfg, tmp_path_factory)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", sorted(set(CONFIGS) - COVERED_ELSEWHERE))
def test_world_run_equals_single_process_run(algorithm, tmp_path_factory):
    cfg = parse_config(_merge(CONFIGS[algorithm], {"rounds": 2, "eval_every": 2}))
    compare_world_with_alone(cfg, tmp_path_factory)


def compare_world_with_alone(cfg, tmp_path_factory) -> None:  # noqa: ANN001
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    path = run_engine(cfg, world, tmp_path_factory.mktemp("w") / "r.h5")
    if world.Get_rank() == 0:
        alone = run_engine(cfg, MPI.COMM_SELF, tmp_path_factory.mktemp("s") / "r.h5")
        assert_same(deterministic(path), deterministic(alone))
