"""The dashboard's HTML pages, rendered on the server from :mod:`.data` (every value escaped).

Pages: the run overview (numbers of the last step, held-out evaluations, curves drawn in the
browser by the vendored uPlot from the step rows embedded in the page and refreshed from
``api/steps``), nodes (state, ban reason, throughput, version held, verdicts, reputation, last
heartbeat, a link to the admin-only log tail), weight versions (what each store holds and which
version each role and node reports) and the ledger explorer (filter by node or kind; the
chain's verification status; a page at a time, newest first). Knows nothing about HTTP or where
the data comes from.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any
from urllib.parse import urlencode

from swarmrl.roles.orchestrator.dashboard.data import NodeRow, RunData

NAV = (("", "overview"), ("nodes", "nodes"), ("versions", "versions"), ("ledger", "ledger"))
OVERVIEW_KEYS = (
    "reward_mean",
    "accuracy",
    "loss",
    "kl",
    "clip_fraction",
    "staleness",
    "rollout_s",
    "update_s",
    "tokens_per_s",
)


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return escape(str(value))


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], css: str = "") -> str:
    """A table; cells are HTML already escaped by the caller."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def layout(title: str, active: str, body: str, *, head: str = "", base: str = "/ui/") -> str:
    links = " ".join(
        f'<a href="{base}{href}" class="{"on" if href == active else ""}">{name}</a>'
        for href, name in NAV
    )
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{escape(title)} · swarmrl</title>"
        f"<base href='{base}'><link rel='icon' href='data:,'>"
        "<link rel='stylesheet' href='static/dashboard.css'>"
        f"{head}</head><body><header><b>swarmrl</b> <nav>{links}</nav></header>"
        f"<main><h1>{escape(title)}</h1>{body}</main></body></html>"
    )


def overview(data: RunData, base: str) -> str:
    rows = data.step_rows()
    last = rows[-1] if rows else {}
    numbers = _table(
        ["steps", *OVERVIEW_KEYS],
        [[str(len(rows))] + [_fmt(last.get(k)) for k in OVERVIEW_KEYS]],
        "numbers",
    )
    evals = data.report().get("eval", {})
    held_out = [
        [escape(name), _fmt(evals[name].get("accuracy"))]
        for name in ("before", "after", "control")
        if isinstance(evals.get(name), dict)
    ]
    for point in evals.get("during", []) or []:
        held_out.append([f"step {_fmt(point.get('step'))}", _fmt(point.get("accuracy"))])
    charts = "".join(
        f'<div class="chart" id="chart-{name}"></div>'
        for name in ("reward", "loss", "time", "staleness", "mismatch")
    )
    # "</" cannot appear inside the JSON (escaped), so the script element cannot be closed early
    steps_json = json.dumps(rows).replace("</", "<\\/")
    body = (
        f"<p>steps recorded: <span id='step-count'>{len(rows)}</span></p>{numbers}"
        "<h2>held-out accuracy</h2>"
        + (_table(["evaluation", "accuracy"], held_out) if held_out else "<p>none yet</p>")
        + f"<h2>curves</h2><div class='charts'>{charts}</div>"
        f"<script id='steps-data' type='application/json'>{steps_json}</script>"
    )
    head = (
        "<link rel='stylesheet' href='static/uPlot.min.css'>"
        "<script src='static/uPlot.iife.min.js'></script>"
        "<script src='static/dashboard.js'></script>"
    )
    return layout("run overview", "", body, head=head, base=base)


# submission counts per node, in the words of swarmrl.ledger.counts
COUNT_COLUMNS = ("taken_in", "checked", "accepted", "rejected", "invalidated", "trained")


def _node_cells(row: NodeRow, pool_id: str, now: float) -> list[str]:
    v = row.view
    state = f'<span class="state {escape(v.state)}">{escape(v.state)}</span>'
    if row.ban_reason:
        state += f'<div class="reason">{escape(row.ban_reason)}</div>'
    beat = f"{now - v.last_beat_at:.0f} s ago" if v.last_beat_at else "never"
    logs = f'<a href="nodes/{escape(pool_id)}/{escape(v.node_id)}/logs">log tail</a>'
    return [
        f"<code>{escape(v.node_id[:12])}</code>",
        state,
        _fmt(v.measured_tokens_per_s),
        _fmt(v.model_version),
        *(str(getattr(row.counts, word)) for word in COUNT_COLUMNS),
        f"{v.reputation:.2f}",
        beat,
        logs,
    ]


@dataclass(frozen=True)
class LedgerQuery:
    """What the ledger explorer shows: entries older than ``before`` (None: the newest),
    of nodes whose id starts with ``node`` (hex), of one ``kind`` ("" for all)."""

    node: str = ""
    kind: str = ""
    before: int | None = None


def nodes(data: RunData, base: str) -> str:
    now = time.time()
    parts = [] if data.has_pool else [f"<p>{escape(data.no_pool)}</p>"]
    chain = data.verify_ledger() if data.has_pool else None
    if chain is not None and chain.state != "verified":  # the counts come from verified entries
        parts.append(
            f"<p>submission counts from the ledger's verified entries only: {escape(chain.state)}"
            f" ({escape(chain.detail)})</p>"
        )
    for pool in data.pools():
        pool_id = pool.spec.pool_id
        rows = [_node_cells(r, pool_id, now) for r in data.nodes(pool_id)]
        headers = ["node", "state", "tokens/s", "version"]
        headers += [word.replace("_", " ") for word in COUNT_COLUMNS]
        headers += ["reputation", "last heartbeat", "logs (admin)"]
        parts.append(f"<h2>pool {escape(pool_id)}</h2>" + _table(headers, rows, "nodes"))
    roles = [
        [
            escape(s.name),
            escape(s.role),
            escape(s.state),
            _fmt(s.policy_version),
            f"{now - s.updated_at:.0f} s ago",
            escape(", ".join(f"{k}={v:.4g}" for k, v in sorted(s.metrics.items()))),
        ]
        for s in data.statuses()
    ]
    if roles:
        headers = ["role", "kind", "state", "version", "reported", "numbers"]
        parts.append("<h2>roles of this run</h2>" + _table(headers, roles, "roles"))
    return layout("nodes", "nodes", "".join(parts) or "<p>no pools</p>", base=base)


def node_logs(data: RunData, pool_id: str, node_id: str, base: str) -> str:
    text = escape("\n".join(data.node_logs(pool_id, node_id))) or "(no lines reported)"
    body = f"<p>pool {escape(pool_id)}, node <code>{escape(node_id)}</code></p><pre>{text}</pre>"
    return layout("node log tail", "nodes", body, base=base)


def versions(data: RunData, base: str) -> str:
    parts = []
    pool_rows = [[escape(p.spec.pool_id), str(p.current_version)] for p in data.pools()]
    if data.has_pool:
        parts.append(_table(["pool", "version announced"], pool_rows))
    else:
        parts.append(f"<p>{escape(data.no_pool)}</p>")
    stores = [
        [
            escape(s.name),
            ", ".join(str(v) for v in s.versions) or "none",
            _fmt(max(s.versions, default=None)),
        ]
        for s in data.weight_stores()
    ]
    if stores:
        parts.append(
            "<h2>weight stores</h2>" + _table(["store", "versions held", "latest"], stores)
        )
    held = [
        [escape(s.name), escape(s.role), _fmt(s.policy_version)]
        for s in data.statuses()
        if s.role in ("worker", "validator", "trainer")
    ]
    for pool in data.pools():
        for row in data.nodes(pool.spec.pool_id):
            held.append(
                [
                    f"<code>{escape(row.view.node_id[:12])}</code>",
                    "pool node",
                    _fmt(row.view.model_version),
                ]
            )
    parts.append("<h2>who holds which version</h2>" + _table(["client", "kind", "version"], held))
    return layout("weight versions", "versions", "".join(parts), base=base)


def ledger(data: RunData, query: LedgerQuery, limit: int, base: str) -> str:
    if not data.has_pool:
        return layout("ledger", "ledger", f"<p>{escape(data.no_pool)}</p>", base=base)
    chain = data.verify_ledger()
    found = data.ledger_page(
        before=query.before, node_prefix=query.node, kind=query.kind, limit=limit
    )
    rows = [
        [
            str(e["seq"]),
            time.strftime("%H:%M:%S", time.gmtime(e["ts"])),
            escape(e["kind"]),
            escape(e["pool_id"] or ""),
            f"<code>{escape((e['node_id'] or '')[:12])}</code>",
            f"<code>{escape(json.dumps(e['body'])[:300])}</code>",
        ]
        for e in found.entries
    ]
    form = (
        "<form method='get' action='ledger'>"
        f"node id starts with <input name='node' value='{escape(query.node)}'> "
        f"kind <input name='kind' value='{escape(query.kind)}'> <button>filter</button></form>"
    )
    filters = {k: v for k, v in (("node", query.node), ("kind", query.kind)) if v}
    links = []
    if query.before is not None:
        links.append(f"<a href='ledger?{escape(urlencode(filters))}'>newest</a>")
    if found.older is not None:
        older = urlencode({**filters, "before": found.older, "limit": limit})
        links.append(f"<a class='older' href='ledger?{escape(older)}'>older entries</a>")
    if found.entries:
        shown = f"entries {found.entries[0]['seq']} down to {found.entries[-1]['seq']} shown"
    else:
        shown = "no matching entries here"
    body = (
        f"<p class='chain {chain.state}'>chain: <b>{chain.state}</b> ({escape(chain.detail)})</p>"
        f"{form}"
        f"<p>{found.total} entries in the ledger; {shown} (newest first)</p>"
        + _table(["seq", "time (UTC)", "kind", "pool", "node", "body"], rows, "ledger")
        + f"<p class='pages'>{' · '.join(links)}</p>"
    )
    return layout("ledger", "ledger", body, base=base)


def message(title: str, text: str, base: str) -> str:
    return layout(title, "", f"<p>{escape(text)}</p>", base=base)


def login(next_page: str, base: str, failed: bool = False) -> str:
    note = "<p class='reason'>wrong token</p>" if failed else ""
    body = (
        f"{note}<p>Admin pages (nodes, weight versions, node log tails) need the token in the orchestrator's "
        "<code>ui-admin-token</code> file.</p>"
        "<form method='post' action='login'>"
        f"<input type='hidden' name='next' value='{escape(next_page)}'>"
        "token <input type='password' name='token' autocomplete='off'> "
        "<button>sign in</button></form>"
    )
    return layout("admin sign-in", "", body, base=base)
