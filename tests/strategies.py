"""Hypothesis strategies shared by the schedule and timeline property tests."""

from __future__ import annotations

from hypothesis import strategies as st

# Every argument combination build_schedule accepts, small enough to check exhaustively per example.
schedule_cases = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(1, 12),
        "num_steps": st.integers(1, 3),
        "num_slots": st.integers(1, 4),  # 1 = the no-overlap baseline; 2 = published
        "num_landing": st.integers(1, 3),
        "requests_per_load": st.integers(1, 3),
        "mode": st.sampled_from(("allgather", "rank-local")),
        "warm_start": st.booleans(),
        "prefetch_next": st.booleans(),
        "slot_offset": st.integers(0, 3),
        "landing_offset": st.integers(0, 2),
    }
)


def build_case(case: dict):
    """The schedule of a generated case, with offsets folded into range and no landing buffers in rank-local."""
    from dlo_fn.plan.schedule import build_schedule

    kw = dict(case)
    kw["slot_offset"] %= kw["num_slots"]
    if kw["mode"] == "rank-local":
        kw["num_landing"], kw["landing_offset"] = 0, 0
    else:
        kw["landing_offset"] %= kw["num_landing"]
    return build_schedule(kw.pop("num_blocks"), kw.pop("num_steps"), **kw)


# Load groups: G loads moving as one on S = m * G slots, m >= 2; rank-local, or allgather on N = n * G landing
# buffers, n >= 1 (its offset any: _build reduces it).
rank_local_grouped_cases = st.integers(2, 3).flatmap(
    lambda g: st.fixed_dictionaries(
        {
            "num_blocks": st.integers(1, 12),
            "num_steps": st.integers(1, 3),
            "num_slots": st.integers(2, 3).map(lambda m: m * g),
            "num_landing": st.just(0),
            "requests_per_load": st.integers(1, 3),
            "mode": st.just("rank-local"),
            "warm_start": st.booleans(),
            "prefetch_next": st.booleans(),
            "slot_offset": st.integers(0, 8),
            "landing_offset": st.just(0),
            "load_group": st.just(g),
        }
    )
)
allgather_grouped_cases = st.integers(2, 3).flatmap(
    lambda g: st.fixed_dictionaries(
        {
            "num_blocks": st.integers(1, 12),
            "num_steps": st.integers(1, 3),
            "num_slots": st.integers(2, 3).map(lambda m: m * g),
            "num_landing": st.integers(1, 3).map(lambda n: n * g),
            "requests_per_load": st.integers(1, 3),
            "mode": st.just("allgather"),
            "warm_start": st.booleans(),
            "prefetch_next": st.booleans(),
            "slot_offset": st.integers(0, 8),
            "landing_offset": st.integers(0, 8),
            "load_group": st.just(g),
        }
    )
)
grouped_cases = st.one_of(rank_local_grouped_cases, allgather_grouped_cases)
