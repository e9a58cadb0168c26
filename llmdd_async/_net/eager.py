"""Small requests planned by the initiator from the peer's table, so that no GRANT waits.

A small push over the stream waits a round trip for its GRANT before its bytes may leave,
then another for the RESULT. In remote-accessible mode the initiator knows the target's cache
from the peer's table, so it can plan the push itself (the planner is the target's own,
:func:`~.grants.plan_selection`) and send the bytes right behind the request, with the
digest of its plan (:func:`stream_digest`). The target plans the request as always; it lands
the bytes only if its own plan has that digest and it serves the request from its reader
(:func:`~.target.serve_now`), and then answers with the RESULT alone. Otherwise it answers
with a GRANT, as for any push, discards the early bytes (DATA flagged ``FLAG_EAGER`` lands
only where the target took the push as sent), and the initiator sends them again under the
GRANT. Every check of the target stays: the early bytes change who waits, not what may land
where.

A small pull is planned the same way (:func:`eager_pull_plan`): the initiator sets up where
its stream lands before the request leaves, and the request carries the digest of those
ranges of its own cache. A target whose plan has that digest sends the DATA alone, flagged
``FLAG_EAGER``, with no GRANT to decode and check; otherwise the GRANT and unflagged DATA, as
always. Flagged DATA lands only in the plan the initiator made (inside its own cache) and
only until a GRANT replaces that plan.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .._checks import check_same_dtype
from .._errors import LLMException
from .._messages import By, Grant, Mode, Op
from .._planner import Plan, check_within, u64_sum
from .._transports.tcp import INLINE_BYTES
from .grants import TransferRequest, plan_selection, selection_bound
from .host import LinkHost
from .link import Link
from .prepared import plan_prepared
from .streams import VIEWS_INLINE

__all__ = [
    "EAGER_BYTES",
    "as_planned",
    "eager_field",
    "eager_plan",
    "eager_pull_plan",
    "stream_digest",
]

#: requests of at most this much are planned here (what the target serves from its reader)
EAGER_BYTES = INLINE_BYTES


def stream_digest(ranges: np.ndarray, nbytes: np.ndarray) -> int:
    """The digest of an eager push's layout (``Request.eager``): the initiator's ranges in
    stream order and their lengths (BLAKE2b, 8 bytes, as an int64). A push planned from a table
    that no longer says what the target holds has another digest there: it is sent again
    under a GRANT, never landed in the wrong place."""
    h = hashlib.blake2b(np.ascontiguousarray(ranges, dtype="<u8").tobytes(), digest_size=8)
    h.update(np.ascontiguousarray(nbytes, dtype="<u8").tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def eager_plan(engine: LinkHost, link: Link, spec: TransferRequest) -> Plan | None:
    """The plan of a push whose bytes may follow its request (its ranges of our cache, in the
    order the target's plan will read the stream), or None: then it waits for its GRANT.

    Only a push over the stream (the request claims no direct access), in remote-accessible
    mode, to a cache by id that the peer's table publishes as host memory, of at most
    ``EAGER_BYTES`` of host memory in at most ``VIEWS_INLINE`` ranges: what the target serves
    from its reader. A selection that does not fit is left to the target, which says why.
    """
    if spec.op != Op.PUSH:
        return None
    planned = _plan_here(engine, link, spec)
    return planned[0] if planned is not None and engine.host_reachable(planned[0].src) else None


def eager_pull_plan(engine: LinkHost, link: Link, spec: TransferRequest) -> Plan | None:
    """The plan of a pull whose DATA may come with no GRANT before it (where its stream lands
    in our cache, in the order the target sends it), or None: then the GRANT says where.

    As :func:`eager_plan`, for a pull into host memory: the target compares the digest of its
    own plan's ranges of our cache with ours and, only where they are the same, sends its
    DATA flagged ``FLAG_EAGER`` and no GRANT; it lands where we planned, inside our own cache
    (the peer's table shapes the plan, so a plan in full is checked here). A GRANT that comes
    instead replaces this plan.
    """
    if spec.op != Op.PULL:
        return None
    planned = _plan_here(engine, link, spec)
    if planned is None or not engine.host_reachable(planned[0].dst):
        return None
    plan, prepared = planned
    # (a prepared pair places blocks of our own layout, its indices checked: in our cache)
    return plan if prepared or check_within(plan.dst, plan.nbytes, *spec.local.regions) else None


def eager_field(ours: np.ndarray, nbytes: np.ndarray) -> tuple[int, int]:
    """The ``eager`` field of a request planned here (``ours``: its ranges of our cache, a
    push's source or a pull's destination, in stream order): its bytes and their digest."""
    return u64_sum(nbytes), stream_digest(ours, nbytes)


def as_planned(req_id: int, ours: np.ndarray, nbytes: np.ndarray, eager: tuple[int, int]) -> Grant:
    """The grant a request planned here stands for (``eager``: its :func:`eager_field`)."""
    return Grant(req_id, mode=Mode.STREAM, total=eager[0], done=False, local=ours, nbytes=nbytes)


def _plan_here(engine: LinkHost, link: Link, spec: TransferRequest) -> tuple[Plan, bool] | None:
    """A small request over the stream planned from the peer's table (see the module), and
    whether a prepared pair planned it; None where the target must plan it (it then also says
    what does not fit)."""
    target = spec.target
    if not engine.options.remote_accessible or target.by is not By.CACHE_ID:
        return None
    view = link.view
    cache_id = target.cache_id
    tgt = view.layout(cache_id)
    if tgt is None or view.device_memory(cache_id):
        return None  # (the target stages device memory from a task: it would grant)
    push = spec.op == Op.PUSH
    try:
        theirs, ours = view.dtype(cache_id), spec.local.dtype
        if theirs != ours:  # (the message costs microseconds)
            src, dst = (ours, theirs) if push else (theirs, ours)
            check_same_dtype(src, dst, spec.op.value)
        nbytes, ranges = selection_bound(spec)
        if nbytes > EAGER_BYTES or ranges > VIEWS_INLINE:
            return None  # not planned here as well as there (nor planned at all: cheap)
        # Blocks from the pair kept for them (it checked that the source lies in its
        # regions: our cache for a push, what the peer published for a pull).
        regions = spec.local.regions if push else view.regions
        planned = plan_prepared(view.pairs, spec, tgt, regions, EAGER_BYTES)
        if planned is not None:
            if not 0 < planned.total_bytes <= EAGER_BYTES or len(planned) > VIEWS_INLINE:
                return None
            return planned, True
        plan, _, _ = plan_selection(
            spec.op,
            spec.shape,
            spec.local.layout,
            tgt,
            target.index,
            local_slot=spec.local_slot,
            src_range=spec.src_range,
            dst_range=spec.dst_range,
            tnpl=spec.tensor_num_per_layer,
            size=spec.size,
            src_offset=spec.src_offset,
            dst_offset=spec.dst_offset,
            src_blocks=spec.src_blocks,
            dst_blocks=spec.dst_blocks,
            dst_block_bytes=spec.dst_block_bytes,
            max_bytes=EAGER_BYTES,
        )
    except LLMException:
        return None
    if (
        not 0 < plan.total_bytes <= EAGER_BYTES
        or len(plan) > VIEWS_INLINE
        # (the peer's table shapes the plan: whatever it says, we read only our own cache)
        or (push and not check_within(plan.src, plan.nbytes, *spec.local.regions))
    ):
        return None
    return plan, False
