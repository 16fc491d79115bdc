"""Every algorithm gives bitwise the same results on 1, 2, 3 and 4 ranks (server plus 0 to 3 workers), from one
4-rank job: the world, then sub-communicators of its first 3 and 2 ranks, and one rank alone (the fourth, beside the
3-rank run)."""

import pytest

from mpifl.comm.transport import arrive_together
from mpifl.registry import known_algorithms, parse_config
from tests.conftest import _merge, assert_same, deterministic, run_engine, shared_dir
from tests.test_checkpoint import CONFIGS, SERVER_OPTIMIZERS
from tests.test_vectorized import IMAGES as VECTORIZED_IMAGES
from tests.test_vectorized import KERNEL_ALGORITHMS, NEWLY_BATCHED

WIRE = {"compression": {"up": {"codec": "qsgd", "bits": 6, "error_feedback": True}, "down": {"codec": "bf16"}},
        "privacy": {"mode": "local", "clip": 1.0, "noise_multiplier": 0.05}}


def same_on_1_to_4_ranks(raw: dict, name: str, tmp_path_factory) -> None:  # noqa: ANN001
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    cfg = parse_config(raw)
    directory = shared_dir(tmp_path_factory, name)
    paths = {}
    for size in (4, 3, 2):
        comm = world.Split(0 if world.Get_rank() < size else MPI.UNDEFINED, world.Get_rank())
        if comm != MPI.COMM_NULL:
            paths[size] = run_engine(cfg, comm, directory / f"p{size}.h5")
            comm.Free()
        elif world.Get_rank() == size == 3:  # the rank the 3 ranks leave out runs alone meanwhile
            run_engine(cfg, MPI.COMM_SELF, directory / "p1.h5")
        arrive_together(world)
    if world.Get_rank() == 0:
        alone = deterministic(directory / "p1.h5")
        for path in paths.values():
            assert_same(deterministic(path), alone)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("algorithm", known_algorithms())
def test_results_are_bitwise_the_same_on_1_to_4_ranks(algorithm, tmp_path_factory):
    same_on_1_to_4_ranks(_merge(CONFIGS[algorithm], {"rounds": 2, "eval_every": 1}), f"ranks_{algorithm}",
                         tmp_path_factory)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("algorithm", known_algorithms())
def test_codecs_and_privacy_give_the_same_bits_on_1_to_4_ranks(algorithm, tmp_path_factory):
    """Any algorithm with a stochastic codec with error feedback on every float upload, bf16 downloads and local
    DP (its updates clipped and noised), so every keyed draw, encoding and residual must match across ranks."""
    # Local uploads no update; FedBuff's asynchronous steps have no round cohort for DP's accounting
    wire = WIRE if algorithm not in ("local", "fedbuff", "fedasync") else {"compression": WIRE["compression"]}
    same_on_1_to_4_ranks(_merge(CONFIGS[algorithm], {"rounds": 1, "eval_every": 1, **wire}), f"wire_{algorithm}",
                         tmp_path_factory)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("run", sorted(SERVER_OPTIMIZERS))
def test_adaptive_server_optimizers_give_the_same_bits_on_1_to_4_ranks(run, tmp_path_factory):
    """FedAdam, FedYogi and FedAdagrad steps (and their moments) from sums that never depend on the ranks."""
    same_on_1_to_4_ranks(_merge(SERVER_OPTIMIZERS[run], {"rounds": 3, "eval_every": 1}), f"ranks_{run}",
                         tmp_path_factory)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("algorithm", KERNEL_ALGORITHMS + NEWLY_BATCHED)
def test_vectorized_cnn_clients_give_the_same_bits_on_1_to_4_ranks(algorithm, tmp_path_factory):
    """CNN clients in the torch.func kernel (calls of 4 rows): 6 clients of unequal sizes are one group of 6 on
    one worker and groups of 2 on three, so each rank count pads and splits the calls differently."""
    raw = _merge(_merge(CONFIGS[algorithm], VECTORIZED_IMAGES), {"rounds": 2, "eval_every": 1,
                                                                  "client": {"vectorize": True}})
    same_on_1_to_4_ranks(raw, f"vectorized_{algorithm}", tmp_path_factory)
