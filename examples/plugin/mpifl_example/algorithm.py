"""FedAvg whose server moves only ``rate`` of the way to the clients' weighted average."""

from dataclasses import dataclass, field

from mpifl.algorithms.base import weighted_sum
from mpifl.algorithms.fedavg import FedAvgClient, FedAvgServer
from mpifl.schema import limits


@dataclass(frozen=True)
class DampedOptions:  # the config section `damped_fedavg: {rate: 0.5}`, validated like mpifl's own
    rate: float = field(default=0.5, metadata=limits(gt=0, le=1))


class DampedServer(FedAvgServer):
    def apply_deltas(self, step, rows):  # FedAvg's handler of its "delta" message (FedAvgServer.handlers)
        mean_delta = weighted_sum(rows, self.ctx.weights(step.clients))
        self.model.step(self.ctx.options.rate * mean_delta)


ALGORITHM = (DampedOptions, DampedServer, FedAvgClient)  # (options or None, server class, client class)
