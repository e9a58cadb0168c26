"""A push in one round trip: its bytes follow its XFER_REQ at once, before any GRANT.

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
"""

from __future__ import annotations

import hashlib

import numpy as np

from .._checks import check_same_dtype
from .._errors import LLMException
from .._messages import By, Op
from .._planner import Plan, check_within
from .._transports.tcp import INLINE_BYTES
from .grants import TransferRequest, plan_selection, selection_bound
from .host import LinkHost
from .link import Link
from .prepared import plan_prepared
from .streams import VIEWS_INLINE

__all__ = ["EAGER_BYTES", "eager_plan", "stream_digest"]

#: pushes of at most this much go with their request (what the target lands from its reader)
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
    target = spec.target
    if spec.op != Op.PUSH or not engine.options.remote_accessible or target.by is not By.CACHE_ID:
        return None
    nbytes, ranges = selection_bound(spec)
    if nbytes > EAGER_BYTES or ranges > VIEWS_INLINE:
        return None  # not planned here as well as there
    view = link.view
    tgt = view.layout(target.cache_id)
    if tgt is None or view.device_memory(target.cache_id):
        return None  # (the target stages device memory from a task: it would grant)
    try:
        check_same_dtype(spec.local.dtype, view.dtype(target.cache_id), "push")
        # A few blocks from the pair kept for them (it checked they lie in our cache).
        planned = plan_prepared(view.pairs, spec, tgt, spec.local.regions, EAGER_BYTES)
        if planned is not None:
            if not 0 < planned.total_bytes <= EAGER_BYTES or len(planned) > VIEWS_INLINE:
                return None
            return planned if engine.host_reachable(planned.src) else None
        plan, _, _ = plan_selection(
            Op.PUSH,
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
        or not engine.host_reachable(plan.src)
        # (the peer's table shapes the plan: whatever it says, we read only our own cache)
        or not check_within(plan.src, plan.nbytes, *spec.local.regions)
    ):
        return None
    return plan
