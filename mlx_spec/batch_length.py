"""How many tokens each round of a batch drafts: :class:`BatchAdaptive`.

The rule of :class:`mlx_spec.draft_length.Adaptive`, applied to a batch
(:mod:`mlx_spec.batch`): one ``N`` for the round, each row drafting up to it, which maximises the
batch's ``sum_i E_i(min(N, cap_i))`` over its cost, each row's acceptance estimated as
``Adaptive`` estimates it, and the costs a :class:`mlx_spec.draft_length.Calibration` for each
batch size, measured as ``Adaptive`` measures one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .draft_length import (
    Adaptive,
    Calibration,
    Outcome,
    Round,
    _check_policy,
    _expected,
    _fastest,
    _Meter,
)

__all__ = ["BatchAdaptive"]


class BatchAdaptive:
    """One ``N`` a round for a batch, each row drafting ``min(N, cap_i)``: the ``N`` that
    maximises the batch's tokens per second.

    Each row keeps its own acceptance estimate, an :class:`Adaptive` (:meth:`sequence`) that the
    batch tells each of the row's outcomes, untimed. A round of ``B`` rows drafting ``N`` yields
    ``sum_i E_i(min(N, cap_i))`` tokens and costs ``Calibration.cost(N)`` of batch size ``B``;
    a plain step of ``B`` rows yields ``B`` tokens for its ``plain`` seconds. A batch size's
    calibration is measured in its first rounds and plain steps as :class:`Adaptive` measures
    one, then kept, so that drafting stops where the batch has grown too large for it to pay.
    Where plain steps have tested no row's draft for a while, a test round of the most tokens
    runs, as :class:`Adaptive` runs one (:data:`mlx_spec.draft_length.EXPLORE`).

    Args:
        most (int): the most draft tokens a round, in ``[1, MAX_DRAFT_TOKENS]``. Default: ``8``.
        calibrations (Mapping, optional): batch size (``int >= 1``) to its :class:`Calibration`,
            kept in the attribute ``calibrations``. Default: none; each measured when first met.
        decay (float): each row's estimate's decay, in ``(0, 1]`` (:class:`Adaptive`).
            Default: ``0.97``.
    """

    def __init__(
        self,
        most: int = 8,
        calibrations: Mapping[int, Calibration] | None = None,
        decay: float = 0.97,
    ) -> None:
        _check_policy("BatchAdaptive", most, decay)
        given = dict(calibrations or {})
        for size, calibration in given.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"BatchAdaptive: `calibrations` must map batch sizes >= 1, got key {size!r}"
                )
            if not isinstance(calibration, Calibration):
                raise ValueError(
                    f"BatchAdaptive: `calibrations[{size}]` must be a Calibration, got "
                    f"{calibration!r}"
                )
        self.most = most
        self.decay = decay
        self.calibrations = given
        self._meters: dict[int, _Meter] = {}
        # Plain steps since a row's draft token was last tested.
        self._untested = 0

    def sequence(self) -> Adaptive:
        """A new row's acceptance estimate, to tell that row's outcomes (without seconds)."""
        return Adaptive(self.most, decay=self.decay)

    def choose(self, rows: Sequence[tuple[Adaptive, Round]]) -> int:
        """``N`` for the next round of ``len(rows)`` rows, each a row's estimate and situation
        (its cap and label); ``0`` runs a plain step."""
        top = min(self.most, max((r.cap for _, r in rows), default=0))
        if top == 0:
            return 0
        calibration = self.calibrations.get(len(rows))
        if calibration is None:
            return self._meters.setdefault(len(rows), _Meter()).length(top)
        expected = [(_expected(estimate.acceptance(r.label), top), r.cap) for estimate, r in rows]
        # Each row's E(min(N, cap)) for N = 0 .. top, summed over the rows.
        tokens = [sum(e[min(n, cap)] for e, cap in expected) for n in range(top + 1)]
        return _fastest(tokens, calibration, 1, self._untested, self.most)

    def observe(self, rows: int, outcome: Outcome) -> None:
        """Learns the timed ``outcome`` of a round (``drafted``: its ``N``) or plain step
        (``drafted``: the rows whose guess it tested) of ``rows`` rows."""
        self._untested = 0 if outcome.drafted else self._untested + outcome.plain
        if rows in self.calibrations or outcome.seconds is None:
            return
        calibration = self._meters.setdefault(rows, _Meter()).record(outcome)
        if calibration is not None:
            self.calibrations[rows] = calibration
