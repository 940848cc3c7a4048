"""Tests for pipelining: schedules, validation rules, timing against closed forms (the grid,
``Pipeline`` and the CLI: test_pipelining_surface.py)."""

from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipelining as pl
from pipelining import (B, F, I, W, Action, ActionKind, Schedule, ScheduleError,
                        bubble_fraction_closed_form, bubble_time_closed_form, gpipe, interleaved_1f1b, make_schedule, one_f_one_b, peak_in_flight,
                        relative_bubble_closed_form, simulate, validate, violations, zero_bubble)
from pipelining._engine import needs

FLAT = ("gpipe", "1f1b", "zero_bubble")
FLAT_CASES = [(name, p, m) for name in FLAT for p in (1, 2, 3, 4)
              for m in sorted({1, max(1, p - 1), p, 2 * p + 1})]
INTERLEAVED_CASES = [(p, m, v) for p in (1, 2, 3, 4) for m in (p, 2 * p) for v in (2, 3)]


# ------------------------------------------------------------------ generators
@pytest.mark.parametrize("name,p,m", FLAT_CASES)
def test_flat_schedules_are_valid_with_exact_counts(name, p, m):
    s = make_schedule(name, p, m)
    assert validate(s) is s and violations(s) == []
    assert (s.name, s.ranks, s.microbatches, s.virtual_stages, s.stages) == (name, p, m, 1, p)
    kinds = {"gpipe": {F: m, B: m}, "1f1b": {F: m, B: m}, "zero_bubble": {F: m, I: m, W: m}}
    for r in range(p):
        assert s[r] == s.actions[r]
        assert Counter(a.kind for a in s[r]) == kinds[name]
        assert {a.stage for a in s[r]} == {r} and s.rank_of(r) == r
        for kind in kinds[name]:
            assert sorted(a.microbatch for a in s[r] if a.kind is kind) == list(range(m))
    assert s.num_actions == p * sum(kinds[name].values())


@pytest.mark.parametrize("p,m,v", INTERLEAVED_CASES)
def test_interleaved_is_valid_with_exact_counts(p, m, v):
    s = interleaved_1f1b(p, m, virtual_stages=v)
    validate(s)
    assert (s.ranks, s.microbatches, s.virtual_stages, s.stages) == (p, m, v, p * v)
    for r in range(p):
        assert Counter(a.kind for a in s[r]) == {F: v * m, B: v * m}
        assert {a.stage for a in s[r]} == set(s.stages_of(r)) == {r + c * p for c in range(v)}
        assert all(s.rank_of(a.stage) == r and a.stage % p == r for a in s[r])
    # Megatron's warm-up on rank r: min((v-1) p + 2 (p-1-r), v m) forwards before the first B.
    for r in range(p):
        warmup = min((v - 1) * p + 2 * (p - 1 - r), v * m)
        first_b = next(i for i, a in enumerate(s[r]) if a.kind is B)
        assert first_b == (warmup + 1 if warmup < v * m else v * m)


def test_interleaved_with_one_virtual_stage_is_1f1b():
    for m in (1, 3, 5):
        assert interleaved_1f1b(3, m, 1).actions == one_f_one_b(3, m).actions


def test_last_stage_backward_starts_the_backward_pass():
    for s in (gpipe(3, 4), one_f_one_b(3, 4), zero_bubble(3, 4), interleaved_1f1b(3, 3, 2)):
        res = simulate(s)
        first = min((t for row in res.timelines for t in row if t.action.kind is not F),
                    key=lambda t: t.start)
        assert first.action.stage == s.stages - 1


# ------------------------------------------------------------------ closed forms
@pytest.mark.parametrize("name,p,m", [c for c in FLAT_CASES if c[0] != "zero_bubble"])
def test_gpipe_and_1f1b_bubble_fraction(name, p, m):
    res = simulate(make_schedule(name, p, m), cost_f=1, cost_b=2)
    assert res.bubble_fraction == (p - 1) / (m + p - 1)
    assert res.bubble_fraction == bubble_fraction_closed_form(name, p, m)
    assert res.makespan == (m + p - 1) * 3
    assert res.idle == tuple([(p - 1) * 3.0] * p)
    assert res.idle[0] == bubble_time_closed_form(name, p, m)
    assert res.busy == tuple([m * 3.0] * p)


costs = st.fractions(min_value=Fraction(1, 8), max_value=8, max_denominator=8)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b"]), p=st.integers(1, 5), m=st.integers(1, 9),
       f=costs, b=costs)
def test_gpipe_and_1f1b_fraction_independent_of_costs(name, p, m, f, b):
    res = simulate(make_schedule(name, p, m), f, b, b / 2)
    assert res.bubble_fraction == (p - 1) / (m + p - 1)


@pytest.mark.parametrize("p,m,v", INTERLEAVED_CASES)
def test_interleaved_relative_bubble(p, m, v):
    res = simulate(interleaved_1f1b(p, m, v), cost_f=1, cost_b=2, cost_w=1)
    assert res.relative_bubble == pytest.approx((p - 1) / (v * m), rel=1e-12, abs=1e-15)
    assert all(x == pytest.approx((p - 1) * 3 / v) for x in res.idle)
    assert res.relative_bubble == pytest.approx(relative_bubble_closed_form(
        "interleaved_1f1b", p, m, v), abs=1e-15)
    assert res.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-15)
    # Interleaving divides the 1F1B bubble by v.
    flat = simulate(one_f_one_b(p, m))
    assert res.idle[0] == pytest.approx(flat.idle[0] / v)


@pytest.mark.parametrize("p,m", sorted({(p, m) for _, p, m in FLAT_CASES if m >= p}))
@pytest.mark.parametrize("cf,cb,cw", [(1, 2, 1), (2, 3, 1), (3, 5, 1)])
def test_zero_bubble_h1_bubble(p, m, cf, cb, cw):
    ci = cb - cw
    res = simulate(zero_bubble(p, m), cf, cb, cw)
    assert res.idle == tuple([float((p - 1) * (cf + ci - cw))] * p)
    assert res.idle[0] == bubble_time_closed_form("zero_bubble", p, m, 1, cf, cb, cw)
    ref = simulate(one_f_one_b(p, m), cf, cb, cw)
    assert ref.idle[0] == (p - 1) * (cf + cb)
    assert res.makespan == ref.makespan - 2 * (p - 1) * cw


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 5), extra=st.integers(0, 6), f=costs, i=costs, w=costs)
def test_zero_bubble_general_costs(p, extra, f, i, w):
    m = p + extra
    res = simulate(zero_bubble(p, m), f, i + w, w)
    expect = (p - 1) * max(f, i, f + i - w)
    assert res.idle == tuple([float(expect)] * p)
    assert res.idle[0] == bubble_time_closed_form("zero_bubble", p, m, 1, f, i + w, w)


def test_zero_bubble_closed_form_needs_m_at_least_p():
    with pytest.raises(ValueError, match=r"m >= p.*m=2 < p=3"):
        bubble_fraction_closed_form("zero_bubble", 3, 2)


def test_closed_form_values_and_errors():
    assert bubble_fraction_closed_form("interleaved_1f1b", 4, 8, v=2) == 3 / 19
    assert bubble_fraction_closed_form("gpipe", 4, 8) == bubble_fraction_closed_form("1f1b", 4, 8)
    assert bubble_fraction_closed_form("gpipe", 4, 8, cost_f=3, cost_b=5, cost_w=1) == 3 / 11
    assert relative_bubble_closed_form("interleaved_1f1b", 4, 8, v=3) == 3 / 24
    assert bubble_time_closed_form("zero_bubble", 4, 8) == 3.0
    with pytest.raises(ValueError, match="unknown schedule 'x'; choose from gpipe"):
        bubble_fraction_closed_form("x", 2, 2)
    with pytest.raises(ValueError, match=r"m=6 to be a multiple of ranks p=4"):
        bubble_fraction_closed_form("interleaved_1f1b", 4, 6, v=2)
    with pytest.raises(ValueError, match=r"gpipe runs one stage per rank, so v must be 1, got 2"):
        bubble_fraction_closed_form("gpipe", 4, 8, v=2)
    with pytest.raises(ValueError, match=r"cost_w must be smaller than cost_b"):
        bubble_time_closed_form("1f1b", 2, 2, 1, 1, 1, 1)


@pytest.mark.parametrize("name,p,m", FLAT_CASES)
def test_peak_in_flight(name, p, m):
    s = make_schedule(name, p, m)
    expected = {"gpipe": m, "1f1b": min(m, p), "zero_bubble": min(m, p)}[name]
    assert peak_in_flight(s, 0) == expected
    for r in range(p):
        per_rank = {"gpipe": m, "1f1b": min(m, p - r), "zero_bubble": min(m, p)}[name]
        assert peak_in_flight(s, r) == per_rank
        assert pl.in_flight_profile(s, r)[-1] == 0


def test_simulated_timelines_respect_dependencies_and_rank_order():
    for s in (zero_bubble(4, 9), interleaved_1f1b(3, 6, 3), gpipe(3, 2)):
        res = simulate(s, 1, 3, 1)
        ends = {}
        for row in res.timelines:
            for t in row:
                ends[t.action] = t.end
        for r, row in enumerate(res.timelines):
            assert [t.action for t in row] == list(s[r])
            for prev, cur in zip(row, row[1:]):
                assert cur.start >= prev.end
            for t in row:
                for stage, tag, j in needs(t.action, s.stages):
                    kinds = {"F": (F,), "I": (I,), "G": (B, I)}[tag]
                    dep = [ends[a] for a in ends if a.stage == stage and a.microbatch == j
                           and a.kind in kinds]
                    assert len(dep) == 1 and t.start >= dep[0]
        assert res.makespan == max(t.end for row in res.timelines for t in row)


def test_simulate_cost_errors():
    s = one_f_one_b(2, 2)
    with pytest.raises(ValueError, match=r"cost_w must be smaller than cost_b.*cost_b=2.*cost_w=2"):
        simulate(s, 1, 2, 2)
    with pytest.raises(ValueError, match=r"cost_f must be > 0, got -1"):
        simulate(s, -1)
    with pytest.raises(TypeError, match="cost_b must be a positive real"):
        simulate(s, 1, True)
    with pytest.raises(ValueError, match="finite"):
        simulate(s, float("inf"))
    with pytest.raises(TypeError, match="expected a Schedule"):
        simulate("1f1b")


# ------------------------------------------------------------------ actions
@settings(max_examples=100, deadline=None)
@given(stage=st.integers(0, 10**6), kind=st.sampled_from(list(ActionKind)),
       mb=st.integers(0, 10**6))
def test_action_str_parse_round_trip(stage, kind, mb):
    a = Action(stage, kind, mb)
    assert str(a) == f"{stage}{kind.value}{mb}"
    assert Action.parse(str(a)) == a
    assert eval(repr(a), {"Action": Action, "ActionKind": ActionKind}) == a


def test_action_text_examples_and_errors():
    assert str(Action(1, F, 0)) == "1F0"
    assert Action.parse("12B3") == Action(12, B, 3)
    assert Action.parse(" 0W7 ") == Action(0, "W", 7)
    for bad in ["", "F0", "1F", "1X0", "1f0", "-1F0", "1F0x", "1 F0", "1٣F0"]:
        with pytest.raises(ValueError, match=r"not an action.*<stage><kind><microbatch>"):
            Action.parse(bad)
    with pytest.raises(TypeError):
        Action.parse(10)
    with pytest.raises(ValueError, match="Action: stage must be an int >= 0, got -1"):
        Action(-1, F, 0)
    with pytest.raises(TypeError, match="Action: microbatch must be an int >= 0"):
        Action(0, F, True)
    with pytest.raises(ValueError, match="kind must be one of F, B, I, W, got 'X'"):
        Action(0, "X", 0)


# ------------------------------------------------------------------ validation
def _rule(schedule):
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    err = info.value
    assert f"R{err.rule} " in str(err) and isinstance(err, ValueError)
    return err


def test_validate_missing_forward():
    s = one_f_one_b(2, 2)
    broken = s.with_actions([s[0], tuple(a for a in s[1] if a != Action(1, F, 0))])
    err = _rule(broken)
    assert (err.rule, err.rank, err.actions) == (1, 1, (Action(1, F, 0),))
    assert "1F0 is missing" in str(err)


def test_validate_backward_before_forward():
    broken = Schedule.from_text("1f1b", ["0B0 0F0 0F1 0B1", "1F0 1B0 1F1 1B1"], microbatches=2)
    err = _rule(broken)
    assert (err.rule, err.rank) == (3, 0) and Action(0, B, 0) in err.actions
    assert "0B0 (position 0) comes before its forward 0F0" in str(err)


def test_validate_weight_before_input_gradient():
    broken = Schedule.from_text("zb", ["0F0 0W0 0I0", "1F0 1I0 1W0"], microbatches=1)
    err = _rule(broken)
    assert (err.rule, err.rank, err.actions) == (3, 0, (Action(0, W, 0), Action(0, I, 0)))


def test_validate_deadlock():
    broken = Schedule.from_text("dl", ["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"], microbatches=2)
    assert [v.rule for v in violations(broken)] == [4]
    err = _rule(broken)
    assert err.rule == 4 and err.rank == 0
    assert set(err.actions) == {Action(0, B, 0), Action(1, F, 1)}
    msg = str(err)
    assert "deadlock" in msg and "rank 0 is stuck at 0B0 waiting for 1B0 or 1I0" in msg
    assert "rank 1 is stuck at 1F1 waiting for 0F1" in msg
    assert "invalid" in str(broken)  # str() of an invalid schedule does not raise


def test_validate_wrong_rank():
    s = one_f_one_b(2, 2)
    f10, b11 = Action(1, F, 0), Action(1, B, 1)
    broken = s.with_actions([(f10,) + s[0], tuple(a for a in s[1] if a != f10)])
    err = _rule(broken)
    assert (err.rule, err.rank, err.actions) == (1, 0, (Action(1, F, 0),))
    assert "runs on rank 0 but stage 1 lives on rank 1" in str(err)
    moved_b = s.with_actions([s[0] + (b11,), tuple(a for a in s[1] if a != b11)])
    assert (_rule(moved_b).rule, _rule(moved_b).rank) == (2, 0)


def test_validate_backward_rules_and_ranges():
    mixed = Schedule.from_text("x", ["0F0 0B0 0I0 0W0"], microbatches=1)
    assert _rule(mixed).rule == 2 and "both B and I/W" in str(_rule(mixed))
    no_w = Schedule.from_text("x", ["0F0 0I0"], microbatches=1)
    assert _rule(no_w).rule == 2 and "1 I and 0 W" in str(_rule(no_w))
    twice = Schedule.from_text("x", ["0F0 0B0 0B0"], microbatches=1)
    assert _rule(twice).rule == 2
    never = Schedule.from_text("x", ["0F0"], microbatches=1)
    assert "never backwarded" in str(_rule(never))
    out_of_range = Schedule.from_text("x", ["0F0 0B0 0F1 0B1"], microbatches=1)
    err = _rule(out_of_range)
    assert err.rule == 0 and "micro-batches 0..0" in str(err) and "more violation" in str(err)
    dup_f = Schedule.from_text("x", ["0F0 0F0 0B0"], microbatches=1)
    assert _rule(dup_f).rule == 1 and "appears 2 times" in str(_rule(dup_f))
    assert [v.rule for v in violations(Schedule.from_text("x", ["", ""], microbatches=1))] \
        == [1, 1, 2, 2]


def test_rules_are_documented():
    assert sorted(pl.RULES) == [0, 1, 2, 3, 4]
