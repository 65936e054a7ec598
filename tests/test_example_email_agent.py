"""examples/email_agent: the synthetic inbox is seeded, every question has one source email that FTS5
search finds from the question's words, keywords cannot break the FTS5 query, and the reward (pure logic)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "email_agent"))

from inbox import (  # noqa: E402
    TOOLS,
    answer_reward,
    build_index,
    contains_fact,
    fts_query,
    make_inbox,
    make_scenario,
    read_email,
    search_inbox,
)


def test_inboxes_are_seeded() -> None:
    assert make_inbox(7) == make_inbox(7)
    assert make_inbox(7) != make_inbox(8)
    emails = make_inbox(7, n_emails=10)
    assert [e.message_id for e in emails] == [f"m{i:04d}" for i in range(10)]
    assert [e.date for e in emails] == sorted(e.date for e in emails)
    assert make_scenario(random.Random(3)) == make_scenario(random.Random(3))
    with pytest.raises(ValueError, match="at most"):
        make_inbox(0, n_emails=1000)


@pytest.mark.parametrize("n_emails", [8, 30])
def test_the_answer_is_in_exactly_one_email_and_search_finds_it(n_emails: int) -> None:
    for seed in range(40):
        scenario = make_scenario(random.Random(seed), n_emails)
        emails = list(scenario.emails)
        assert len(emails) == n_emails
        (source,) = scenario.sources
        holding = [e.message_id for e in emails if contains_fact(e.body, scenario.answer)]
        assert holding == [source]
        about = [e.message_id for e in emails if scenario.keyword.lower() in (e.subject + e.body).lower()]
        assert about == [source]
        assert scenario.keyword in scenario.question
        conn = build_index(emails)
        # the question's own words, OR'ed, rank the source first; the keyword alone finds only it
        assert search_inbox(conn, scenario.question.split())[0]["message_id"] == source
        (hit,) = search_inbox(conn, [scenario.keyword])
        assert hit["message_id"] == source and contains_fact(hit["snippet"], scenario.answer)
        assert scenario.answer in read_email(conn, source)["body"]


def test_keywords_with_fts5_syntax_do_not_raise() -> None:
    conn = build_index(make_inbox(1, n_emails=10))
    nasty = ['"', "AND", "OR NOT", "NEAR(a b)", "*", "-", "^x", "col:val", "(", "'; DROP TABLE emails; --"]
    for keyword in nasty:
        assert isinstance(search_inbox(conn, [keyword]), list)
    assert isinstance(search_inbox(conn, nasty), list)
    assert search_inbox(conn, []) == []
    assert search_inbox(conn, ["", "  ", "?!"]) == []
    assert fts_query(["Flight", "to", "flight", "Berlin?"]) == '"Flight" OR "to" OR "Berlin"'
    assert fts_query("Berlin trip") == '"Berlin" OR "trip"'
    assert len(search_inbox(conn, ["the"], max_results=3)) == 3


def test_read_email() -> None:
    emails = make_inbox(2, n_emails=10)
    conn = build_index(emails)
    email = read_email(conn, "m0003")
    assert email is not None
    assert (email["message_id"], email["subject"], email["body"]) == (
        "m0003",
        emails[3].subject,
        emails[3].body,
    )
    assert read_email(conn, "m9999") is None
    assert read_email(conn, "' OR 1=1 --") is None


def test_contains_fact() -> None:
    assert contains_fact("At 12:45.", "12:45")
    assert contains_fact("1245", "12:45")
    assert not contains_fact("112:45", "12:45")
    assert not contains_fact("19:00", "9:00")
    assert contains_fact("lh 452", "LH452")
    assert not contains_fact("LH4521", "LH452")
    assert not contains_fact("anything", "")


def test_reward() -> None:
    scenario = make_scenario(random.Random(5), n_emails=10)
    (source,) = scenario.sources
    # right answer with its source: 1 + 0.1
    reward, metrics = answer_reward(
        f"It is {scenario.answer}.", [source], scenario, found_source=True, read_source=True, turns=3
    )
    assert reward == pytest.approx(1.1)
    assert metrics["correct"] == metrics["cited_source"] == metrics["answered"] == 1.0
    assert metrics["turns"] == 3.0
    # right answer without (or with a wrong) source: 1
    assert answer_reward(scenario.answer, [], scenario)[0] == pytest.approx(1.0)
    assert answer_reward(scenario.answer, ["m9999", "x"], scenario)[0] == pytest.approx(1.0)
    # a cited source counts once
    assert answer_reward(scenario.answer, [source, source], scenario)[0] == pytest.approx(1.1)
    # wrong answer: only the partial credit for searching, reading and citing the right email
    reward, metrics = answer_reward("no idea", ["m9999"], scenario, tool_errors=2)
    assert reward == 0.0 and metrics["correct"] == 0.0 and metrics["tool_errors"] == 2.0
    assert answer_reward("no idea", [source], scenario)[0] == pytest.approx(0.1)
    full = answer_reward("no idea", [source], scenario, found_source=True, read_source=True)
    assert full[0] == pytest.approx(0.4) and full[1]["cited_source"] == 1.0
    assert answer_reward("no idea", [], scenario, found_source=True)[0] == pytest.approx(0.1)
    assert answer_reward("no idea", [], scenario, found_source=True, read_source=True)[0] == pytest.approx(
        0.3
    )
    # no final answer at all
    reward, metrics = answer_reward(None, [], scenario, found_source=True)
    assert reward == pytest.approx(0.1) and metrics["answered"] == 0.0
    # pasting a long text that contains the fact is not an answer
    assert answer_reward(" ".join(["word"] * 30 + [scenario.answer]), [], scenario)[1]["correct"] == 0.0


def test_tools_schema() -> None:
    names = [tool["function"]["name"] for tool in TOOLS]
    assert names == ["search_inbox", "read_email", "return_final_answer"]
    for tool in TOOLS:
        # as clients send tools: the endpoint's default tool_strict_level pins the arguments, not `strict`
        assert "strict" not in tool["function"]
        parameters = tool["function"]["parameters"]
        assert parameters["required"] == list(parameters["properties"])
        assert parameters["additionalProperties"] is False
