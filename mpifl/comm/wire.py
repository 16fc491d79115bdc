"""The wire format: what each declared message looks like between a client and the server.

An algorithm declares plain float rows; the runtime asks this plug-in how each message travels, so any
algorithm gets every codec, differential privacy and secure aggregation without a line of its own:

- **codecs** (``compression:``, :mod:`.codecs`): a float message is encoded by its sender into its own number of
  bytes and decoded by its receiver; an upload's error feedback (what the encoding lost) is client state;
- **differential privacy** (``privacy:``, :mod:`.privacy`): an ``update`` message is clipped by its client, noised
  by the client (``local``) or, on the server, its mean noised (``central``);
- **secure aggregation** (``secure_aggregation:``, :mod:`.secagg`): an ``update`` message travels as a masked
  vector of field elements, next to the protocol's own messages, which the ledger counts.

Every random draw is keyed by (seed, round, client, message), so results are the same on every rank count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from mpifl.comm.codecs import Codec, build_codec, codec_rng, encode_with_feedback
from mpifl.comm.config import CodecConfig, CompressionConfig, PrivacyConfig, SecAggConfig
from mpifl.comm.messages import Message, masked_nbytes
from mpifl.comm.privacy import clip_update, noise
from mpifl.comm.secagg import MASKED_INPUT, UNMASKING_ROUND, secagg_messages
from mpifl.schema import ConfigError, build

BROADCAST = -1  # the client key of a payload encoded once for every client


@dataclass
class WireFormat:
    compression: CompressionConfig = CompressionConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    secure_aggregation: str = "none"
    secagg: SecAggConfig = SecAggConfig()
    seed: int = 0
    _codecs: dict[str, tuple[Codec | None, bool]] = field(default_factory=dict)

    def check(self, messages: Iterable[Message]) -> None:
        """Refuse what cannot apply to this protocol's messages (one :class:`ConfigError` line)."""
        messages = list(messages)
        names = {m.name for m in messages}
        unknown = sorted(set(self.compression.messages) - names)
        if unknown:
            raise ConfigError(f"compression.messages: the protocol has no message {unknown[0]!r} "
                              f"(it sends {', '.join(sorted(names))})")
        for msg in messages:
            if msg.name in self.compression.messages and msg.direction == "down" and \
                    self._codec_config(msg).error_feedback:
                raise ConfigError(f"compression.messages.{msg.name}.error_feedback: error feedback is client "
                                  "state, for uploads only")
        updates = [m for m in messages if m.update]
        if (self.privacy.mode != "off" or self.secure_aggregation != "none") and not updates:
            what = "privacy" if self.privacy.mode != "off" else "secure_aggregation"
            raise ConfigError(f"{what}: this algorithm uploads no model update to clip, noise or mask")
        if self.secure_aggregation != "none":
            for msg in updates:
                if self.codec(msg) is not None:
                    raise ConfigError(f"compression: {msg.name} is securely aggregated (sent as masked field "
                                      "elements); it cannot also be encoded")

    def codec(self, msg: Message) -> Codec | None:
        """The codec ``msg`` travels in (``None``: its raw bytes). Only logical float messages are encoded."""
        return self._codec_entry(msg)[0]

    def error_feedback(self, msg: Message) -> bool:
        return self._codec_entry(msg)[1]

    def _codec_config(self, msg: Message) -> CodecConfig:
        """``msg``'s codec section: its own under ``compression.messages``, else its direction's."""
        section = self.compression.messages.get(msg.name)
        if section is not None:
            return build(CodecConfig, section, f"compression.messages.{msg.name}")
        return self.compression.up if msg.direction == "up" else self.compression.down

    def _codec_entry(self, msg: Message) -> tuple[Codec | None, bool]:
        if msg.name not in self._codecs:
            cfg = self._codec_config(msg)
            float_logical = msg.logical and np.dtype(msg.dtype).kind == "f"
            codec = build_codec(cfg) if float_logical else None
            self._codecs[msg.name] = (codec, cfg.error_feedback and codec is not None)
        return self._codecs[msg.name]

    @property
    def masks(self) -> bool:
        return self.secure_aggregation != "none"

    def nbytes(self, msg: Message) -> int:
        """Bytes one client moves for ``msg`` in a real deployment: its encoded size (every codec's output has
        one length per row size), its masked size under secure aggregation, or its raw size. The one size the
        ledger records and the simulated clock (deadlines, round times) charges, so they cannot disagree."""
        if self.masks and msg.update:
            return masked_nbytes(msg.numel, self.secagg.field_bits)
        codec = self.codec(msg)
        return msg.nbytes if codec is None else codec.encoded_nbytes(msg.numel)

    # ------------------------------------------------------------------ uploads
    def changes_uploads(self, msg: Message) -> bool:
        """Whether :meth:`client_upload` changes ``msg``'s rows (clipping and local noise of an update)."""
        return msg.update and self.privacy.mode != "off"

    def client_upload(self, msg: Message, round_: int, client: int, row: np.ndarray
                      ) -> np.ndarray:
        """A client's row of ``msg`` as it leaves the client, before encoding: clipped and (local DP) noised."""
        if not self.changes_uploads(msg):
            return row
        row = clip_update(row, self.privacy.clip)
        if self.privacy.mode == "local":
            std = self.privacy.noise_multiplier * self.privacy.clip
            row = row + noise(self.seed, round_, client, msg.name, msg.numel, std, row.dtype)
        return row

    def encode(self, msg: Message, round_: int, client: int, row: np.ndarray, residual: np.ndarray | None
               ) -> tuple[np.ndarray, np.ndarray | None]:
        """``row`` encoded for the wire, and the client's new error-feedback residual (``None`` without)."""
        codec = require_codec(self.codec(msg), msg)
        rng = codec_rng(self.seed, round_, client, msg.name)
        if self.error_feedback(msg):
            return encode_with_feedback(codec, row, residual, rng)
        return codec.encode(row, rng), None

    def decode(self, msg: Message, blob: np.ndarray) -> np.ndarray:
        """The row a receiver reads from ``blob``."""
        return require_codec(self.codec(msg), msg).decode(blob, msg.numel, msg.dtype)

    def server_noise(self, msg: Message, round_: int, rows: np.ndarray) -> np.ndarray:
        """Central DP: the accepted rows of an update with N(0, (z·C)²)/n added to each, so that their uniform
        mean is the mean of the clipped updates plus the noise of the sum divided by n (DP-FedAvg)."""
        if not msg.update or self.privacy.mode != "central" or not len(rows):
            return rows
        std = self.privacy.noise_multiplier * self.privacy.clip
        return rows + noise(self.seed, round_, BROADCAST, msg.name, msg.numel, std, rows.dtype) / len(rows)

    def server_noise_total(self, msg: Message, round_: int, totals: np.ndarray) -> np.ndarray:
        """Central DP on a summed message: N(0, (z·C)²) added to each group's sum of the accepted clipped updates
        (then divided as the algorithm divides: the mean's noise is that of the sum over the divisor, DP-FedAvg's
        calibration, as :meth:`server_noise` gives for rows)."""
        if not msg.update or self.privacy.mode != "central":
            return totals
        std = self.privacy.noise_multiplier * self.privacy.clip
        draws = [noise(self.seed, round_, BROADCAST, msg.name if g == 0 else f"{msg.name}:{g}", msg.numel, std,
                       np.float64) for g in range(len(totals))]
        return totals + np.stack(draws)

    # ---------------------------------------------------------- secure aggregation
    def secagg_round(self, cohort: int, survivors: int, update_numel: int) -> list[tuple[Message, bool]]:
        """The secure-aggregation protocol's own messages of one round (each sized for one client, :meth:`nbytes`),
        besides the masked input; with each, whether only the survivors send or receive it (the unmasking)."""
        return [(Message(m.name, m.direction, m.nbytes, "uint8"), m.name in UNMASKING_ROUND)
                for m in secagg_messages(self.secure_aggregation, cohort, update_numel, self.secagg, survivors)
                if m.name != MASKED_INPUT]


def require_codec(codec: Codec | None, msg: Message) -> Codec:
    if codec is None:
        raise RuntimeError(f"{msg.name} is not encoded")
    return codec
