"""The web page's HTML: plain string templates, every value escaped, nothing loaded from
anywhere (the Content-Security-Policy of report.html holds: no script, no external request).

Progress refreshes without a script: a page with a queued or running job reloads itself every
few seconds (``<meta http-equiv="refresh">``), which the policy allows. The upload form is a page
of its own, so that no reload ever empties a form being filled in.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import quote

from quant.measure.bars import DEFAULT_MAX_DRIFT
from quant.report.verdict import Verdict

from ...job_states import ACTIVE
from ...report_html import CSP, CSS
from ...report_html import escape as e
from ...schemas import JobOut
from ...storage import ArtifactInfo
from ..intake import MAX_DRIFT_LIMIT
from .session import CSRF_FIELD, PREFIX

REFRESH_S = 2
STATE_CLASS = {
    "succeeded": "status-ok",
    "partial": "status-over_bar",
    "failed": "status-failed",
    "cancelled": "muted",
}
UI_CSS = """
header{background:#1d2330;color:#fff}header nav{max-width:1100px;margin:0 auto;padding:10px 24px;
display:flex;gap:18px;align-items:center}header a{color:#fff}header .who{margin-left:auto}
header form{display:inline}button,input[type=submit]{font:inherit;padding:5px 14px;
cursor:pointer}header button{background:none;border:1px solid #8a93a6;color:#fff}
progress{width:160px;vertical-align:middle}.error-box{border:1px solid #b3261e;background:#fdecea;
padding:8px 12px;margin:12px 0}form.upload label{display:block;margin:10px 0 2px;font-weight:600}
form.upload .hint{font-weight:400;color:#666}fieldset{border:1px solid #d6dae1;margin:10px 0}
.actions{display:flex;gap:12px;align-items:center;margin:12px 0}.actions form{display:inline}
input[type=password]{font:inherit;padding:5px;width:min(36em,100%)}
.verdicts{display:flex;flex-wrap:wrap;gap:4px 10px}.verdict{white-space:nowrap}
"""


def _state(job: JobOut) -> str:
    css = STATE_CLASS.get(job.state, "")
    return f'<span class="{css}">{e(job.state)}</span>'


def _progress(job: JobOut) -> str:
    label = f"{job.percent:.0f} %"
    if job.state not in ACTIVE:
        return e(label)
    return f'<progress value="{job.percent:.1f}" max="100">{e(label)}</progress> {e(label)}'


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _verdict_chips(job: JobOut, verdicts: Sequence[Verdict]) -> str:
    """The job list's cell: each target's status and agreement (its name alone until the job
    has a report)."""
    if not verdicts:
        return e(", ".join(job.targets))
    chips = "".join(
        f'<span class="verdict" data-target="{e(v.target)}">{e(v.target)} '
        f'<span class="status-{e(v.status)}">{e(v.status)}</span>'
        f"{'' if v.agreement is None else ' ' + e(_pct(v.agreement))}</span>"
        for v in verdicts
    )
    return f'<span class="verdicts">{chips}</span>'


def _npu_split(verdict: Verdict) -> str:
    if verdict.npu_ops is None or verdict.cpu_ops is None:
        return "-"
    return f"{verdict.npu_ops} / {verdict.cpu_ops}"


def verdict_table(verdicts: Sequence[Verdict]) -> str:
    """The job page's first table: per target, whether it shipped, what int8 cost, how fast
    the shipped file ran here and, on the Ethos-U, which ops Vela put on the NPU."""
    rows = []
    for v in verdicts:
        latency = "-" if v.p50_ms is None else f"{v.p50_ms:.3f} ({v.runtime})"
        drop = "-" if v.drop_pts is None else f"{v.drop_pts:.1f} pt"
        why = f'<tr class="reason"><td></td><td colspan="6" class="error">{e(v.error)}</td></tr>'
        rows.append(
            f'<tr data-target="{e(v.target)}"><td>{e(v.target)}</td>'
            f'<td class="status-{e(v.status)}">{e(v.status)}</td>'
            f'<td class="num">{e(_pct(v.agreement))}</td><td class="num">{e(drop)}</td>'
            f"<td>{e(v.precision)}</td><td class='num'>{e(latency)}</td>"
            f"<td class='num'>{e(_npu_split(v))}</td></tr>" + (why if v.error else "")
        )
    return (
        '<table id="verdict-table"><thead><tr><th>target</th><th>status</th><th>agreement</th>'
        "<th>top-1 drop</th><th>precision</th><th>p50 ms, 1 thread</th><th>NPU / CPU ops</th>"
        f"</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _csrf_field(csrf: str) -> str:
    return f'<input type="hidden" name="{CSRF_FIELD}" value="{e(csrf)}">'


def page(
    title: str,
    body: str,
    *,
    csrf: str | None = None,
    signed_in: bool = False,
    refresh: bool = False,
) -> str:
    """A whole page: the navigation, then ``body``; ``refresh``: reload every few seconds."""
    nav = [f'<a href="{PREFIX}/">Conversions</a>', f'<a href="{PREFIX}/new">New conversion</a>']
    if signed_in and csrf is not None:
        nav.append(
            f'<form class="who" method="post" action="{PREFIX}/signout">{_csrf_field(csrf)}'
            '<button type="submit">Sign out</button></form>'
        )
    meta = f'<meta http-equiv="refresh" content="{REFRESH_S}">' if refresh else ""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"{meta}<title>{e(title)} · edge-un</title><style>{CSS}{UI_CSS}</style></head>"
        f"<body><header><nav><strong>edge-un</strong>{''.join(nav)}</nav></header>"
        f"<main><h1>{e(title)}</h1>{body}</main></body></html>\n"
    )


def error_box(message: str | None) -> str:
    return f'<div class="error-box" role="alert">{e(message)}</div>' if message else ""


def signin_page(csrf: str, error: str | None = None) -> str:
    body = (
        f"{error_box(error)}<p>Sign in with an API token of this service (on its host: "
        "<code>edge-un token create NAME</code>). The browser keeps it in a cookie no script "
        f'can read.</p><form method="post" action="{PREFIX}/signin">{_csrf_field(csrf)}'
        '<p><label for="token">API token</label><br><input type="password" id="token" '
        'name="token" autocomplete="current-password" required></p>'
        '<p><button type="submit" id="signin">Sign in</button></p></form>'
    )
    return page("Sign in", body)


def jobs_page(
    listing: Sequence[tuple[JobOut, Sequence[Verdict]]],
    total: int,
    csrf: str,
    notice: str | None = None,
) -> str:
    """The caller's conversions, each with its targets' verdicts once it has a report."""
    jobs = [job for job, _ in listing]
    rows = []
    for job, verdicts in listing:
        link = f"{PREFIX}/jobs/{quote(job.id)}"
        rows.append(
            f'<tr id="job-{e(job.id)}"><td><a href="{e(link)}">{e(job.inputs.model)}</a></td>'
            f'<td class="state">{_state(job)}</td><td class="progress">{_progress(job)}</td>'
            f"<td>{e(job.stage or '-')}</td>"
            f'<td class="targets">{_verdict_chips(job, verdicts)}</td>'
            f"<td>{e(f'{job.created_at:%Y-%m-%d %H:%M:%S}')} UTC</td></tr>"
        )
    if not rows:
        rows.append(
            '<tr><td colspan="6" class="muted">No conversions yet: '
            f'<a href="{PREFIX}/new">start one</a>.</td></tr>'
        )
    shown = f"<p class='muted'>The newest {len(jobs)} of {total}.</p>" if total > len(jobs) else ""
    body = (
        f'{error_box(notice)}<table id="jobs-table"><thead><tr><th>model</th><th>state</th>'
        "<th>progress</th><th>stage</th><th>targets</th><th>created</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>{shown}"
    )
    refresh = any(job.state in ACTIVE for job in jobs)
    return page("Conversions", body, csrf=csrf, signed_in=True, refresh=refresh)


def upload_page(targets: Sequence[tuple[str, str]], csrf: str, error: str | None = None) -> str:
    """The upload form. Posted as multipart to a URL carrying the form token: the body goes
    straight to the upload checks, as an API upload does, so the token cannot be a field."""
    boxes = "".join(
        f'<label class="hint"><input type="checkbox" name="targets" value="{e(name)}"> '
        f"<strong>{e(name)}</strong>: {e(board)}</label>"
        for name, board in targets
    )
    action = f"{PREFIX}/new?{CSRF_FIELD}={quote(csrf)}"
    body = (
        f"{error_box(error)}"
        f'<form class="upload" method="post" enctype="multipart/form-data" action="{e(action)}">'
        '<label for="model">Model <span class="hint">(.safetensors, .pt/.pth with a config, '
        ".pt2, .onnx, or a Hugging Face save_pretrained directory as one .zip)</span></label>"
        '<input type="file" id="model" name="model" required>'
        '<label for="model_data">External data <span class="hint">(an ONNX model\'s '
        ".onnx.data files, under the names it references)</span></label>"
        '<input type="file" id="model_data" name="model_data" multiple>'
        '<label for="config">Config <span class="hint">(JSON, for a .pt/.pth state dict)'
        '</span></label><input type="file" id="config" name="config" accept=".json">'
        '<label for="calib">Calibration data <span class="hint">(.npz; default: the data set '
        'the checkpoint records)</span></label><input type="file" id="calib" name="calib">'
        '<label for="eval">Evaluation data <span class="hint">(.npz)</span></label>'
        '<input type="file" id="eval" name="eval">'
        '<fieldset><legend>Targets <span class="hint">(none ticked: all)</span></legend>'
        f"{boxes}</fieldset>"
        '<label for="max_drift">Top-1 drop allowed <span class="hint">(points)</span></label>'
        f'<input type="number" id="max_drift" name="max_drift" value="{DEFAULT_MAX_DRIFT:g}" '
        f'min="0" max="{MAX_DRIFT_LIMIT:g}" step="0.1">'
        '<p><button type="submit" id="upload">Convert</button></p></form>'
    )
    return page("New conversion", body, csrf=csrf, signed_in=True)


def job_page(
    job: JobOut, verdicts: Sequence[Verdict], artifacts: Sequence[ArtifactInfo], csrf: str
) -> str:
    """A conversion: its state, each target's verdict first (once it has a report), what it
    was asked, its actions and files."""
    base = f"{PREFIX}/jobs/{quote(job.id)}"
    facts = [
        ("model", f"{job.inputs.model} ({job.inputs.model_format})"),
        ("targets", ", ".join(job.targets)),
        ("top-1 drop allowed", f"{job.max_drift:g} pt"),
        ("created", f"{job.created_at:%Y-%m-%d %H:%M:%S} UTC"),
        ("finished", "-" if job.finished_at is None else f"{job.finished_at:%H:%M:%S} UTC"),
        ("job id", job.id),
    ]
    rows = "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in facts)
    parts = [
        f'<p id="job-state">{_state(job)} · {_progress(job)} · {e(job.stage or "waiting")}</p>',
        error_box(job.error),
        verdict_table(verdicts) if verdicts else "",
        f"<dl>{rows}</dl>",
    ]
    actions = []
    if artifacts:
        actions.append(f'<a id="report-link" href="{base}/report">Report</a>')
        actions.append(f'<a href="{base}/bundle.zip">Everything (.zip)</a>')
    verb = "Cancel" if job.state in ACTIVE else "Delete"
    actions.append(
        f'<form method="post" action="{base}/{verb.lower()}">{_csrf_field(csrf)}'
        f'<button type="submit" id="{verb.lower()}">{verb}</button></form>'
    )
    parts.append(f'<div class="actions">{"".join(actions)}</div>')
    if artifacts:
        lines = "".join(
            f'<tr><td><a href="{base}/artifacts/{quote(a.name)}" download>{e(a.name)}</a></td>'
            f'<td class="num">{a.bytes:,}</td><td><code>{e(a.sha256)}</code></td></tr>'
            for a in artifacts
        )
        parts.append(
            '<h2>Files</h2><table id="artifacts-table"><thead><tr><th>file</th><th>bytes</th>'
            f"<th>sha256</th></tr></thead><tbody>{lines}</tbody></table>"
        )
    refresh = job.state in ACTIVE
    return page(job.inputs.model, "".join(parts), csrf=csrf, signed_in=True, refresh=refresh)


def message_page(title: str, message: str, csrf: str | None, signed_in: bool) -> str:
    body = f'{error_box(message)}<p><a href="{PREFIX}/">Back to your conversions</a></p>'
    return page(title, body, csrf=csrf, signed_in=signed_in)
