"""Transport and accounting: message declarations, MPI collectives, ledger, network model."""

from mpifl.comm.ledger import Ledger, PhysicalLog
from mpifl.comm.messages import LOCAL, LocalCompute, Message, Step
from mpifl.comm.placement import Placement
from mpifl.comm.transport import Transport

__all__ = ["LOCAL", "Ledger", "LocalCompute", "Message", "PhysicalLog", "Placement", "Step", "Transport"]
