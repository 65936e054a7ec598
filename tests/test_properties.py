"""Property tests of pure parts (Hypothesis): packing trains every sampled token exactly once with the
context it was sampled after, and traffic grouping hands every labeled turn to one group or to its task's
mean, and trajectory groups come back from Parquet as they were written. Each draws tens to hundreds of
cases; a failure prints the smallest case Hypothesis found."""

from __future__ import annotations

import math
import time

from factories import served_choice
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from art_ray import Trajectory, TrajectoryGroup, read_trajectory_groups, write_trajectory_groups
from art_ray.capture.turns import CapturedTurn
from art_ray.feedback import FeedbackRecord
from art_ray.traffic.groups import TaskBaselines, task_key, traffic_groups
from art_ray.traffic.records import LabeledTurn, StoredTurn
from art_ray.trainer.batches import TokenSequence
from art_ray.trainer.packing import PackedStep, pack_step

TOKENS = st.integers(1, 6)  # a small vocabulary: sequences share prefixes often
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def steps(draw: st.DrawFn) -> tuple[list[TokenSequence], int]:
    """A step's sequences: groups whose samples share a prompt (all of them a system prompt, often), each
    sample one to three sampled turns with context between; and a row length they fit in."""
    system = draw(st.lists(TOKENS, max_size=40))
    sequences = []
    for group_id in range(draw(st.integers(1, 4))):
        prompt = draw(st.lists(TOKENS, min_size=1, max_size=10))
        for _ in range(draw(st.integers(1, 4))):
            sequence = TokenSequence(
                group_id=group_id,
                advantage=draw(st.floats(-2, 2, allow_nan=False)),
                weight=draw(st.floats(0.01, 1.0)),
            )
            sequence.extend(system + prompt)
            for turn in range(draw(st.integers(1, 3))):
                if turn:
                    sequence.extend(draw(st.lists(TOKENS, min_size=1, max_size=5)))  # a tool result
                sampled = draw(st.lists(TOKENS, min_size=1, max_size=6))
                logprobs = [-draw(st.floats(0.01, 5.0)) for _ in sampled]
                sequence.extend(sampled, logprobs, temperature=draw(st.sampled_from([0.5, 0.7, 1.0])))
            sequences.append(sequence)
    longest = max(len(s.input_ids) for s in sequences)
    return sequences, longest + draw(st.integers(0, 40))


def members(step: PackedStep) -> list[tuple[list[int], int, list[int]]]:
    """Each packed sequence as (the tokens its last position sees, row index, its own positions)."""
    found = []
    for index, row in enumerate(step.rows):
        parents = {p for p in row.parent_ids if p}
        for segment in sorted(set(row.segment_ids) - {0} - parents):
            own = [t for t, s in enumerate(row.segment_ids) if s == segment]
            parent = row.parent_ids[own[0]]
            shared = [t for t, s in enumerate(row.segment_ids) if parent and s == parent]
            seen = [*step.prefix, *(row.input_ids[t] for t in shared + own)]
            positions = [row.position_ids[t] for t in shared + own]
            assert positions == list(range(len(step.prefix), len(seen)))  # continuous, no gap, no overlap
            found.append((seen, index, own))
    return found


def trains_as(row, own: list[int], sequence: TokenSequence) -> bool:  # noqa: ANN001
    """Whether the row's positions `own` train `sequence`'s sampled tokens (targets, weight, advantage, old
    logprob and temperature) and nothing else."""
    for t in own:
        k = row.position_ids[t]  # predicts token k + 1 of its sequence
        if k + 1 < len(sequence.input_ids) and sequence.trainable[k + 1]:
            expected = (
                sequence.input_ids[k + 1],
                sequence.weight,
                sequence.advantage,
                sequence.logprobs[k + 1],
                sequence.temperatures[k + 1],
            )
            found = (
                row.target_ids[t],
                row.weights[t],
                row.advantages[t],
                row.old_logprobs[t],
                row.temperatures[t],
            )
            if found != expected:
                return False
        elif row.weights[t] != 0.0 or row.advantages[t] != 0.0:
            return False
    return True


@SETTINGS
@given(steps(), st.booleans())
def test_packing_trains_every_sampled_token_once_after_its_own_context(
    drawn: tuple[list[TokenSequence], int], share_step_prefix: bool
) -> None:
    sequences, row_length = drawn
    step = pack_step(sequences, row_length, share_step_prefix=share_step_prefix)
    assert all(len(row.input_ids) == row_length for row in step.rows)
    unmatched = list(sequences)
    for seen, index, own in members(step):
        row = step.rows[index]
        # the packed sequence is one of the step's, whole, in order, trained as that sequence trains (two
        # samples may have the same tokens and differ in what is sampled, its advantage or logprobs)
        candidates = [s for s in unmatched if s.input_ids == seen]
        match = next((s for s in candidates if trains_as(row, own, s)), None)
        assert match is not None, (row, own, candidates)
        unmatched.remove(match)
    assert unmatched == []
    trained = sum(w > 0 for row in step.rows for w in row.weights)
    assert trained == sum(s.num_trainable for s in sequences)
    # nothing outside a member trains: shared prefixes and padding predict context only
    for row in step.rows:
        parents = {p for p in row.parent_ids if p}
        for t, segment in enumerate(row.segment_ids):
            if segment == 0 or segment in parents:
                assert row.weights[t] == 0.0 and not math.isnan(row.old_logprobs[t])


@st.composite
def labeled_turns(draw: st.DrawFn) -> list[LabeledTurn]:
    turns = []
    for index in range(draw(st.integers(1, 12))):
        task = draw(st.sampled_from(["a", "b", "c", None]))
        system = draw(st.sampled_from(["one word", "two words"]))
        turn = CapturedTurn(
            request_messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": f"q{index}"},
            ],
            choice={
                "index": 0,
                "message": {"role": "assistant", "content": "yes"},
                "finish_reason": "stop",
                "token_ids": [7],
                "prompt_token_ids": [1, 2],
                "logprobs": {
                    "content": [{"token": "yes", "logprob": -0.1, "bytes": None, "top_logprobs": []}]
                },
            },
            model="run@0",
            created_at=time.time(),
            completion_id=f"chatcmpl-{index}",
            metadata={"task": task} if task else None,
        )
        scores = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=3))
        feedback = [
            FeedbackRecord(
                feedback_id=f"fb-{index}-{n}",
                completion_id=turn.completion_id,
                model="run",
                score=score,
                received_at=float(n),
            )
            for n, score in enumerate(scores)
        ]
        turns.append(LabeledTurn(stored=StoredTurn(turn=turn), feedback=feedback))
    return turns


@SETTINGS
@given(st.lists(labeled_turns(), min_size=1, max_size=3))
def test_every_labeled_turn_trains_in_one_group_or_starts_its_tasks_mean(
    batches: list[list[LabeledTurn]],
) -> None:
    baselines = TaskBaselines()
    for turns in batches:
        known = {task_key(t.stored.turn): baselines.baseline(task_key(t.stored.turn)) for t in turns}
        counts = {key: (baselines.tasks[key].count if key in baselines.tasks else 0) for key in known}
        groups, report = traffic_groups(turns, baselines)
        grouped = [t.metadata["completion_id"] for g in groups for t in g.trajectories]
        assert len(grouped) == len(set(grouped)) == report.trajectories
        lone_firsts = {
            key
            for key in known
            if known[key] is None and sum(task_key(t.stored.turn) == key for t in turns) == 1
        }
        assert report.first_of_task == len(lone_firsts)
        assert len(grouped) + report.first_of_task == len(turns)
        for group in groups:
            key = group.metadata["task"]
            assert group.baseline == known[key]  # the mean before this batch, or the group's own (None)
            assert all(t.metadata["task"] == key for t in group.trajectories)
        for key in known:  # every reward joined its task's mean
            assert baselines.tasks[key].count == counts[key] + sum(
                task_key(t.stored.turn) == key for t in turns
            )


TEXT = st.text(st.characters(blacklist_categories=["Cs"]), max_size=30)  # any unicode a JSON string holds
METADATA = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.one_of(TEXT, st.integers(-(2**53), 2**53), st.booleans(), st.none()),
    max_size=3,
)


@st.composite
def trajectory_groups(draw: st.DrawFn) -> list[TrajectoryGroup]:
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        trajectories = []
        for _ in range(draw(st.integers(0, 3))):
            items: list = [{"role": "user", "content": draw(TEXT)}]
            for _ in range(draw(st.integers(1, 3))):
                ids = draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=5))
                logprobs = tuple(-draw(st.floats(0, 20)) for _ in ids)
                params = draw(
                    st.one_of(st.none(), st.fixed_dictionaries({"temperature": st.floats(0.1, 2.0)}))
                )
                items.append(served_choice(draw(TEXT), tuple(ids), logprobs, sampling_params=params))
                items.append({"role": "user", "content": draw(TEXT)})
            trajectories.append(
                Trajectory(
                    messages_and_choices=items[:-1],
                    reward=draw(st.floats(-10, 10, allow_nan=False)),
                    metrics=draw(
                        st.dictionaries(st.text(min_size=1, max_size=8), st.floats(-1e6, 1e6), max_size=3)
                    ),
                    metadata=draw(METADATA),
                    logs=draw(st.lists(TEXT, max_size=2)),
                )
            )
        baseline = draw(st.one_of(st.none(), st.floats(-1, 1)))
        groups.append(TrajectoryGroup(trajectories, metadata=draw(METADATA), baseline=baseline))
    return groups


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectory_groups())
def test_groups_come_back_from_parquet_as_they_were_written(groups: list[TrajectoryGroup]) -> None:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "groups.parquet"
        write_trajectory_groups(groups, path)
        restored = read_trajectory_groups(path)
    assert [g.model_dump() for g in restored] == [g.model_dump() for g in groups]


JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=8)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
WELL_FORMED = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=8)}
    ),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "content": st.text(max_size=8), "tool_call_id": st.text(max_size=4)}
    ),
)
MALFORMED = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.one_of(
                st.sampled_from(["system", "user", "tool", "other"]),
                st.lists(st.text(max_size=2), max_size=2),
                st.dictionaries(st.text(max_size=2), st.text(max_size=2), max_size=2),
                JSON_SCALARS,
            ),
            "content": JSON_VALUES,
        }
    ),
    st.dictionaries(
        st.sampled_from(["role", "content", "tool_call_id", "message", "index"]), JSON_VALUES, max_size=3
    ),
    JSON_SCALARS,
)
MESSAGES = st.one_of(
    WELL_FORMED, WELL_FORMED, WELL_FORMED, MALFORMED
)  # mostly valid: both outcomes get cases
FINITE = st.floats(allow_nan=False, allow_infinity=False)


def mostly(valid: st.SearchStrategy, *invalid: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` nine times in ten, else JSON of another shape (or `invalid`)."""
    junk = st.one_of(JSON_SCALARS, *invalid)
    return st.integers(0, 9).flatmap(lambda draw: valid if draw else junk)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "messages_and_choices": mostly(st.lists(MESSAGES, max_size=4)),
            "reward": mostly(FINITE, st.floats()),
            "metrics": mostly(
                st.dictionaries(st.text(max_size=6), st.one_of(FINITE, st.booleans()), max_size=3),
                st.dictionaries(st.text(max_size=6), st.floats(), max_size=3),
            ),
            "metadata": mostly(
                st.dictionaries(
                    st.text(max_size=6), st.one_of(st.text(max_size=4), st.integers(), FINITE), max_size=3
                ),
                st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=3),
            ),
            "initial_policy_version": mostly(st.integers(0, 9)),
            "logs": mostly(st.lists(st.text(max_size=4), max_size=2)),
        },
    )
)
def test_a_trajectory_from_any_json_validates_or_raises_a_validation_error(payload: dict) -> None:
    """Whatever a client sends as a trajectory (the training server's and ART's wire), validation either
    accepts it, with a finite reward and finite metrics, and it round-trips through JSON unchanged, or
    raises pydantic's ValidationError naming the field: never another exception, never a NaN inside."""
    import pydantic

    try:
        trajectory = Trajectory.model_validate(payload)
    except pydantic.ValidationError as error:
        assert error.errors(), payload
        return
    assert math.isfinite(trajectory.reward)
    assert all(not isinstance(v, float) or math.isfinite(v) for v in trajectory.metrics.values())
    again = Trajectory.model_validate_json(trajectory.model_dump_json())
    assert again.model_dump() == trajectory.model_dump()
