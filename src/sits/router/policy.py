"""Routing: which replica gets a request (pure functions of the candidates and the prompt).

- `load_score`: one number per replica from its queue, batch, KV use and overload state.
- `prefix_key`: a per-tenant hash of the prompt's first whole blocks, so that prompts sharing a
  long prefix land where that prefix is already cached (tenants never share a key: the
  replicas' prefix caches are salted per tenant anyway).
- `rendezvous_rank`: highest-random-weight hashing (Thaler & Ravishankar, "Using name-based
  mappings to increase hit rates", IEEE/ACM ToN 1998; tech report 1996): each key ranks the
  replicas by hash(key, url); removing a replica moves only the keys it was first for.
- `choose`: the key's first replica unless it is more than `load_bound` busier than the least
  loaded one, else the least loaded. Ties are broken deterministically (rendezvous order with a
  key, url order without).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from sits.core.errors import InvalidParameterError
from sits.router.registry import Replica

# Added to a replica's load score per overload state: yellow defers borrowing work, red sheds.
# Share of a replica's capacity its overload state weighs, in requests.
OVERLOAD_PENALTY = {"green": 0.0, "yellow": 0.25, "red": 1.0}


class RouteReason(StrEnum):
    """Why a replica was chosen (counted per reason in /metrics)."""

    PREFIX_AFFINITY = "prefix_affinity"
    LEAST_LOADED = "least_loaded"
    LOAD_BOUND = "affinity_over_load_bound"  # the affine replica was too loaded
    FALLBACK = "fallback"  # chosen from the fallback pool
    CANARY = "canary"
    ONLY = "only_candidate"


@dataclass(frozen=True, slots=True)
class RouteChoice:
    """A routing decision: the replica's url and why."""

    url: str
    reason: RouteReason


def load_score(replica: Replica) -> float:
    """How busy a replica is, in requests (0 = idle; higher = busier), from its last heartbeat
    and the requests the router has in flight to it:

        num_waiting + max(num_running, inflight) + kv_cache_usage + penalty x capacity

    with penalty 0 (green), 0.25 (yellow) or 1 (red): a red replica weighs as if a whole batch
    more were queued. Counting requests is the least-request balancing of proxies such as
    Envoy's LEAST_REQUEST; `inflight` is the router's own count, fresh at every request, while
    the heartbeat's `num_running` (which includes them and other clients' requests) is up to one
    heartbeat old, so the larger of the two counts. KV use (0..1) separates replicas that run
    as many requests.
    """
    load = replica.load
    return (
        load.num_waiting
        + max(load.num_running, replica.inflight)
        + load.kv_cache_usage
        + OVERLOAD_PENALTY[load.overload_state] * replica.capacity
    )


def prefix_key(
    tenant_id: str, prompt_text: str, block_chars: int = 256, max_blocks: int = 4
) -> bytes | None:
    """The prompt's affinity key: sha256 over the tenant id and the first
    min(max_blocks, len(prompt_text) // block_chars) whole blocks of `block_chars` characters.

    Returns:
        32 bytes, or None when the text is shorter than one block (no prefix worth keeping).

    Raises:
        InvalidParameterError: `block_chars` or `max_blocks` < 1.
    """
    if block_chars < 1:
        raise InvalidParameterError("block_chars", f"must be >= 1: {block_chars}")
    if max_blocks < 1:
        raise InvalidParameterError("max_blocks", f"must be >= 1: {max_blocks}")
    num_blocks = min(max_blocks, len(prompt_text) // block_chars)
    if num_blocks == 0:
        return None
    tenant = tenant_id.encode()
    digest = hashlib.sha256(len(tenant).to_bytes(4, "big") + tenant)
    digest.update(prompt_text[: num_blocks * block_chars].encode())
    return digest.digest()


def rendezvous_rank(key: bytes, urls: Iterable[str]) -> list[str]:
    """`urls` (duplicates dropped) ordered by the highest-random-weight score of `key`:
    score = the first 8 bytes of sha256(key + url), descending; equal scores by url.
    (Thaler & Ravishankar 1996.)
    """
    scored = [
        (-int.from_bytes(hashlib.sha256(key + url.encode()).digest()[:8], "big"), url)
        for url in dict.fromkeys(urls)
    ]
    return [url for _, url in sorted(scored)]


def choose(
    candidates: Sequence[Replica],
    key: bytes | None,
    load_bound: float,
    exclude: Collection[str] = (),
    tiebreak: bytes | None = None,
) -> RouteChoice | None:
    """Pick a replica among `candidates` whose url is not in `exclude`.

    - One left: it (ONLY).
    - With a key: the key's rendezvous-first replica (PREFIX_AFFINITY), unless its
      `load_score` exceeds the least loaded's by more than `load_bound`: then the least loaded
      (LOAD_BOUND), ties in the key's rendezvous order.
    - Without a key: the least loaded (LEAST_LOADED), ties in `tiebreak`'s rendezvous order
      (the router draws one per request, so equally idle replicas share sequential traffic),
      else by url.

    Args:
        candidates: routable replicas (`Registry.candidates`).
        key: `prefix_key` of the request, or None.
        load_bound: how much busier (in `load_score` units) the affine replica may be, >= 0.
        exclude: urls already tried for this request.
        tiebreak: bytes ordering equally loaded replicas when there is no key, or None.

    Returns:
        The choice, or None when no candidate is left.

    Raises:
        InvalidParameterError: `load_bound` < 0.
    """
    if not load_bound >= 0:
        raise InvalidParameterError("load_bound", f"must be >= 0: {load_bound}")
    left = {r.url: r for r in candidates if r.url not in exclude}
    if not left:
        return None
    if len(left) == 1:
        return RouteChoice(next(iter(left)), RouteReason.ONLY)
    ranking = key if key is not None else tiebreak
    order = rendezvous_rank(ranking, left) if ranking is not None else sorted(left)
    scores = {url: load_score(left[url]) for url in order}
    least = min(order, key=scores.__getitem__)  # min keeps the first of equal scores
    if key is None:
        return RouteChoice(least, RouteReason.LEAST_LOADED)
    first = order[0]
    if scores[first] - scores[least] > load_bound:
        return RouteChoice(least, RouteReason.LOAD_BOUND)
    return RouteChoice(first, RouteReason.PREFIX_AFFINITY)
