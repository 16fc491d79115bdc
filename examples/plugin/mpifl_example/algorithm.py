"""FedAvg whose server moves only ``rate`` of the way to the clients' weighted average."""

from dataclasses import dataclass, field

from mpifl.algorithms.fedavg import FedAvgClient, FedAvgServer
from mpifl.schema import limits


@dataclass(frozen=True)
class DampedOptions:
    """The config section `damped_fedavg: {rate: 0.5}`, validated like mpifl's own."""

    rate: float = field(default=0.5, metadata=limits(gt=0, le=1))  # the share of the way the server moves


class DampedServer(FedAvgServer):
    def apply_deltas(self, step, total):  # FedAvg's handler of "delta": Σ nᵢ·Δᵢ over the accepted clients
        self.model.step(self.ctx.options.rate * (total / self.ctx.divisor(step.clients)))


ALGORITHM = (DampedOptions, DampedServer, FedAvgClient)  # (options or None, server class, client class)
