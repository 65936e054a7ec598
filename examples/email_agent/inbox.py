"""A synthetic inbox, its search tools and the ART-E style reward (pure logic, no art_ray).

`make_inbox(seed)` writes emails from small template vocabularies; each email carries one concrete fact
(a flight number, a meeting time, an invoice amount, an order number, a room) about
one key (a city, a company, a product, ...) that no other email in the inbox mentions. A scenario asks
for the fact of one email by its key, so exactly one email answers it. The agent's tools are
`search_inbox` (SQLite FTS5, keywords OR'ed and ranked by bm25), `read_email` and
`return_final_answer`; `answer_reward` scores the final answer the way ART-E does (right answer, cited
sources) with partial credit for finding and reading the right email.
"""

from __future__ import annotations

import random
import re
import sqlite3
from dataclasses import dataclass, field
from datetime import date, timedelta

PEOPLE = ["Anna", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kim", "Leo"]
ME = "me@example.com"


@dataclass(frozen=True)
class Email:
    message_id: str
    sender: str
    to: str
    date: str  # ISO date
    subject: str
    body: str


@dataclass(frozen=True)
class Kind:
    """One kind of email: the keys it is about, the fact it carries, its text and the question."""

    keys: tuple[str, ...]
    subject: str
    body: str
    question: str
    fact: str  # a format for the fact: {n} a number, {L} an upper-case letter


KINDS = {
    "flight": Kind(
        keys=(
            "Berlin",
            "Paris",
            "Madrid",
            "Oslo",
            "Vienna",
            "Lisbon",
            "Prague",
            "Dublin",
            "Athens",
            "Warsaw",
        ),
        subject="Flight to {key}",
        body="Hi, your flight to {key} is {fact}, leaving on {day}. Have a good trip, {sender}",
        question="What is the flight number of the flight to {key}?",
        fact="{L}{L}{n}{n}{n}",
    ),
    "meeting": Kind(
        keys=(
            "Acme",
            "Globex",
            "Initech",
            "Umbrella",
            "Hooli",
            "Vandelay",
            "Stark",
            "Wayne",
            "Wonka",
            "Tyrell",
        ),
        subject="Meeting with {key}",
        body="Hi, the meeting with {key} is at {fact} on {day} in the main office. Thanks, {sender}",
        question="What time is the meeting with {key}?",
        fact="{hour}:{minute}",
    ),
    "invoice": Kind(
        keys=("Northwind", "Contoso", "Fabrikam", "Litware", "Proseware", "Tailspin", "Adatum", "Lucerne"),
        subject="Invoice from {key}",
        body="Hello, the invoice from {key} is {fact} dollars, due on {day}. Best, {sender}",
        question="How many dollars is the invoice from {key}?",
        fact="{n}{n}{n}",
    ),
    "order": Kind(
        keys=(
            "laptop",
            "bicycle",
            "camera",
            "headphones",
            "keyboard",
            "monitor",
            "tent",
            "printer",
            "guitar",
        ),
        subject="Your {key} order",
        body="Hi, thanks for ordering the {key}. Your order number is {fact}. It ships on {day}. {sender}",
        question="What is the order number of the {key} order?",
        fact="{n}{n}{n}{n}{n}",
    ),
    "room": Kind(
        keys=("budget", "hiring", "roadmap", "security", "marketing", "onboarding", "design", "training"),
        subject="The {key} workshop",
        body="Hi all, the {key} workshop on {day} is in room {fact}. See you there, {sender}",
        question="Which room is the {key} workshop in?",
        fact="{L}{n}{n}",
    ),
}


def _fact(kind: Kind, rng: random.Random) -> str:
    out = kind.fact.replace("{hour}", str(rng.randint(8, 17))).replace(
        "{minute}", rng.choice(["00", "15", "30", "45"])
    )
    out = re.sub(r"\{n\}", lambda _: str(rng.randint(1, 9)), out)
    return re.sub(r"\{L\}", lambda _: rng.choice("ABCDEFGHJKLMNPRSTUVWXYZ"), out)


@dataclass(frozen=True)
class Topic:
    kind: str
    key: str
    fact: str


def make_inbox(seed: int, n_emails: int = 30) -> list[Email]:
    """`n_emails` emails, each about a different key, in date order (the ids follow that order)."""
    return _make(seed, n_emails)[0]


def _clashes(fact: str, emails: list[Email], topics: list[Topic]) -> bool:
    """Whether another email holds `fact`, or `fact` holds another email's (a time 9:45 holds 945)."""
    in_bodies = any(contains_fact(e.body, fact) for e in emails)
    return in_bodies or any(contains_fact(fact, t.fact) for t in topics)


def _make(seed: int, n_emails: int) -> tuple[list[Email], list[Topic]]:
    rng = random.Random(seed)
    pool = [(kind, key) for kind, spec in KINDS.items() for key in spec.keys]
    if n_emails > len(pool):
        raise ValueError(f"at most {len(pool)} emails, asked for {n_emails}")
    chosen = rng.sample(pool, n_emails)
    start = date(2024, 1, 1) + timedelta(days=rng.randrange(300))
    days = sorted(rng.sample(range(60), n_emails))
    emails: list[Email] = []
    topics: list[Topic] = []
    for i, ((kind_name, key), offset) in enumerate(zip(chosen, days, strict=True)):
        kind = KINDS[kind_name]
        sender = rng.choice(PEOPLE)
        sent = start + timedelta(days=offset)
        event_day = (sent + timedelta(days=rng.randint(2, 20))).strftime("%A %B %d").replace(" 0", " ")
        fact = _fact(kind, rng)
        while _clashes(fact, emails, topics):
            fact = _fact(kind, rng)
        fields = {"key": key, "fact": fact, "day": event_day, "sender": sender}
        emails.append(
            Email(
                message_id=f"m{i:04d}",
                sender=f"{sender.lower()}@example.com",
                to=ME,
                date=sent.isoformat(),
                subject=kind.subject.format(**fields),
                body=kind.body.format(**fields),
            )
        )
        topics.append(Topic(kind_name, key, fact))
    return emails, topics


# --- search ---------------------------------------------------------------------------------------


def build_index(emails: list[Email]) -> sqlite3.Connection:
    """An in-memory SQLite database with an FTS5 table over the emails."""
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    conn.execute(
        "CREATE VIRTUAL TABLE emails USING fts5("
        "subject, body, sender, message_id UNINDEXED, date UNINDEXED, recipient UNINDEXED)"
    )
    conn.executemany(
        "INSERT INTO emails (subject, body, sender, message_id, date, recipient) VALUES (?, ?, ?, ?, ?, ?)",
        [(e.subject, e.body, e.sender, e.message_id, e.date, e.to) for e in emails],
    )
    conn.commit()
    return conn


def fts_query(keywords: list[str] | str) -> str:
    """Keywords as an FTS5 query: alphanumeric tokens only, each quoted, OR'ed ('' if none)."""
    if isinstance(keywords, str):
        keywords = [keywords]
    tokens: list[str] = []
    for keyword in keywords:
        for token in re.findall(r"[A-Za-z0-9]+", str(keyword)):
            if token.lower() not in {t.lower() for t in tokens}:
                tokens.append(token)
    return " OR ".join(f'"{token}"' for token in tokens[:16])


def search_inbox(conn: sqlite3.Connection, keywords: list[str] | str, max_results: int = 5) -> list[dict]:
    """The best-ranked (bm25) emails matching any keyword: message_id, subject and a snippet of the body."""
    query = fts_query(keywords)
    if not query:
        return []
    rows = conn.execute(
        "SELECT message_id, subject, snippet(emails, 1, '', '', '...', 24) FROM emails "
        "WHERE emails MATCH ? ORDER BY bm25(emails) LIMIT ?",
        (query, max(1, min(int(max_results), 10))),
    ).fetchall()
    return [{"message_id": m, "subject": s, "snippet": snippet} for m, s, snippet in rows]


def read_email(conn: sqlite3.Connection, message_id: str) -> dict | None:
    row = conn.execute(
        "SELECT message_id, sender, recipient, date, subject, body FROM emails WHERE message_id = ?",
        (str(message_id).strip(),),
    ).fetchone()
    if row is None:
        return None
    return dict(zip(["message_id", "from", "to", "date", "subject", "body"], row, strict=True))


MESSAGE_ID = {"type": "string", "pattern": "^m[0-9]{4}$"}


def _tool(name: str, description: str, properties: dict) -> dict:
    """A tool as clients send it, without `strict`: the endpoint's tool-call grammar pins a call's arguments
    to this schema all the same (ModelConfig.tool_strict_level="parameter", the default), so the bounds
    here (lengths, id pattern, item counts) are what keeps a 135M model's calls short and well-formed."""
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS = [
    _tool(
        "search_inbox",
        "Search the inbox for emails containing any of the keywords.",
        {
            "keywords": {
                "type": "array",
                "items": {"type": "string", "maxLength": 20},
                "minItems": 1,
                "maxItems": 3,
            }
        },
    ),
    _tool("read_email", "Read one email by its message_id.", {"message_id": MESSAGE_ID}),
    _tool(
        "return_final_answer",
        "Give the short final answer and the message_ids of the emails it comes from.",
        {
            # room for an email's first sentence up to its fact (~70 characters at most): at 30, an answer
            # copied from a snippet stopped before the fact, and training drifted toward such copies
            "answer": {"type": "string", "maxLength": 80},
            "sources": {"type": "array", "items": MESSAGE_ID, "maxItems": 2},
        },
    ),
]

# the agent's setting, the same for examples/email_agent and examples/langgraph_email
SYSTEM = (
    "You answer a question about the user's emails with tools. First call search_inbox with one or two "
    "keywords from the question. The results show each email's message_id and text: when one holds the "
    "answer, call return_final_answer with the answer and that message_id; otherwise call read_email."
)
# MAX_TOKENS: the longest call the tools' schemas allow (3 keywords of 20 characters, a token each at worst)
# is ~100 tokens; at 64, 3 of 16 held-out episodes ended in a schema-valid call cut off before its end
EMAILS, MAX_TURNS, MAX_TOKENS, RESULTS = 10, 3, 128, 3
# the last turn must answer: every episode ends in a graded answer, not in a third identical search
LAST_TURN = {"type": "function", "function": {"name": "return_final_answer"}}


# --- scenarios and reward -------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    question: str
    answer: str
    sources: tuple[str, ...]
    keyword: str  # the word of the question that finds the source
    emails: tuple[Email, ...] = field(repr=False)


def make_scenario(rng: random.Random, n_emails: int = 30) -> Scenario:
    """An inbox from a seed drawn from `rng`, and a question whose answer is the fact of one email."""
    emails, topics = _make(rng.randrange(2**31), n_emails)
    i = rng.randrange(n_emails)
    topic = topics[i]
    return Scenario(
        question=KINDS[topic.kind].question.format(key=topic.key),
        answer=topic.fact,
        sources=(emails[i].message_id,),
        keyword=topic.key,
        emails=tuple(emails),
    )


HELD_OUT_SEED = 40_000


def held_out_scenarios(count: int, n_emails: int = EMAILS) -> list[Scenario]:
    """The same `count` held-out scenarios for every run; the first 16 are the example's default set."""
    return [make_scenario(random.Random(HELD_OUT_SEED + i), n_emails) for i in range(count)]


def normalize(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def contains_fact(text: str, fact: str) -> bool:
    """Whether `text` holds `fact` as a whole token, ignoring case and punctuation inside it: "12:45" is in
    "at 12.45" and "1245" but not in "112:45"; "LH452" is in "lh 452"."""
    chars = normalize(fact)
    if not chars:
        return False
    pattern = "[^a-z0-9]*".join(chars)
    return re.search(rf"(?<![a-z0-9]){pattern}(?![a-z0-9])", text.lower()) is not None


MAX_ANSWER_WORDS = 20  # a longer answer (a pasted email) gets no credit for containing the fact
FOUND_CREDIT, READ_CREDIT, SOURCE_CREDIT = 0.1, 0.2, 0.1  # partial credit of a wrong answer, up to 0.4


def answer_reward(
    answer: str | None,
    sources: list[str],
    scenario: Scenario,
    *,
    found_source: bool = False,
    read_source: bool = False,
    turns: int = 0,
    tool_errors: int = 0,
) -> tuple[float, dict[str, float]]:
    """ART-E's reward with partial credit. A right answer (the expected fact, see contains_fact, in an answer
    of at most MAX_ANSWER_WORDS words) scores 1 plus 0.1 per right source cited; otherwise 0.1 if a search
    returned the source email, 0.2 if the agent read it and 0.1 if it cited it. `answer` None: no final
    answer given."""
    given = answer or ""
    correct = len(given.split()) <= MAX_ANSWER_WORDS and contains_fact(given, scenario.answer)
    cited = len({str(s).strip() for s in sources} & set(scenario.sources))
    if correct:
        reward = 1.0 + SOURCE_CREDIT * min(cited, len(scenario.sources))
    else:
        reward = FOUND_CREDIT * found_source + READ_CREDIT * read_source + SOURCE_CREDIT * (cited > 0)
    metrics = {
        "correct": float(correct),
        "found_source": float(found_source),
        "read_source": float(read_source),
        "cited_source": float(cited > 0),
        "answered": float(answer is not None),
        "turns": float(turns),
        "tool_errors": float(tool_errors),
    }
    return reward, metrics
