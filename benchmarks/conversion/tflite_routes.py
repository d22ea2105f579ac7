"""The two TFLite routes side by side: litert-torch (the folded torch program -> LiteRT,
ai-edge-quantizer) against onnx2tf (the fp32 ONNX file -> TensorFlow), for imx93 (Vela).

    .venv/bin/python -m benchmarks.conversion.tflite_routes  # ~2 h on 2 cores, see below
    # or families, trained, scale
    .venv/bin/python -m benchmarks.conversion.tflite_routes --only bundled
    # Markdown and plot from the JSON
    .venv/bin/python -m benchmarks.conversion.tflite_routes --report-only
    (--note "..." adds a sentence on how or where it ran to the results)

Models: the bundled examples (their own data sets) and the nine families of
:mod:`testbed.hf_families` in each form users export them (a ``save_pretrained`` directory, a
``torch.export`` program, a dynamo ONNX file; calib.npz / eval.npz from ``write_data``). Each
model, form and route is one ``quant.pipeline.convert(..., targets="imx93", latency_runs=20)`` in
a fresh process (:func:`worker`) with ``EDGE_UN_TFLITE_ROUTE`` set to that route alone (no
fallback); an ONNX source has no torch program, so its litert-torch row is "n/a". Recorded per
row: the route the report names, status and error, agreement / top-1 drop / cosine of the shipped
file, Vela's NPU / CPU ops, cycles and estimated ms, the ops XNNPACK took and LiteRT's p50 at one
thread, the imx93 build's seconds (progress events, ``TargetClock``), the process's wall time,
the seconds of the route's own two steps (the report's ``tflite_route``) and the largest peak
RSS of one of its processes, the peak RSS of the worker's process tree (itself and the build and
tool processes it starts, sampled every 0.2 s, never below its own VmHWM; ``getrusage``'s
figures are kept too), and how many cores other work on the host kept busy meanwhile.

The ``trained`` group converts real trained models with the bars on for imx93 and imx8mp (one
conversion, two targets): the Swin, DistilBERT and GPT-2 of
:mod:`benchmarks.conversion.hf_families_trained` after ``edge-un finetune --int8-ready``, and a UN
model that was never made int8-ready, the bundled LayerNorm HF ViT through ``edge-un migrate``
alone. Training them takes ~40 min on 2 cores (two at a time); ``EDGE_UN_BENCH_TEACHERS=DIR`` keeps
them for the next run.

The ``scale`` group is BERT-base (HF's default ``BertConfig``, 110 M parameters, 32 tokens) and
ViT-B/16 (``ViTConfig``'s defaults, 224 x 224), UN swapped in, random weights with
trained-looking norm statistics, as ``save_pretrained`` directories through both routes, the
drift bars off: random weights have no margins to keep, so the rows measure the TFLite build's
time and memory, not its accuracy.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common.results import RESULTS, ROOT, benchmark_main, git_commit
from benchmarks.conversion.tflite_routes_report import GROUPS, NAME, ROUTES, markdown, plot

BUNDLED = ("vit-mnist-un", "vit-mnist-ln-to-un", "text-rt-un", "hf-vit-mnist-un", "hf-bert-rt-un")
WORKER_TIMEOUT_S = 1800
NOT_APPLICABLE = "an ONNX source has no torch program (auto takes onnx2tf)"
# the trained group's models, bars on, through both TFLite targets: made by
# benchmarks.conversion.hf_families_trained (LN teacher -> migrate -> int8-ready, kept in
# $EDGE_UN_BENCH_TEACHERS) and, for a UN model that was not made int8-ready, the bundled LN ViT
# through `edge-un migrate` alone
TRAINED = ("hf-vit-un-plain", "swin", "distilbert", "gpt2")
TRAINED_TARGETS = "imx93,imx8mp"


def worker(
    model: str,
    out: str,
    result: str,
    calib: str = "",
    evaluation: str = "",
    bars: str = "on",
    targets: str = "imx93",
) -> None:
    """One conversion for imx93 (and any other ``targets``) in this (fresh) process, its row
    written to ``result`` as JSON: imx93's figures, and each other target's under its name;
    ``bars="off"`` ships the pure int8 file whatever its drift (no fallback ladder)."""
    import psutil

    from benchmarks.conversion.conversion_record import TargetClock
    from benchmarks.speed.latency_stages import tree_memory
    from quant.pipeline import convert

    me, peak, tool_peak, done = psutil.Process(), [0], [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], tree_memory(me)[0])
            tool_peak[0] = max(tool_peak[0], _tool_hwm(me))

    threading.Thread(target=sample, daemon=True).start()
    clock = TargetClock()
    off = {"max_drift": 100.0, "min_agreement": 0.0} if bars == "off" else {}
    try:
        report = convert(model, targets=targets, calib=calib or None, eval=evaluation or None,
                         out_dir=out, progress=clock, latency_runs=20, **off)  # fmt: skip
        row = _target_row(report.targets["imx93"], report.model.input_dtype)
        for name, target in report.targets.items():
            if name != "imx93":
                row[name] = _other_target(target)
    except Exception as error:  # a failed row, not a failed run
        row = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
    done.set()
    hwm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text()
               .splitlines() if line.startswith("VmHWM:"))  # fmt: skip
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    row |= {"build_s": clock.per_target().get("imx93"), "convert_s": time.perf_counter()
            - clock.started, "peak_rss_gb": max(peak[0], hwm) / 1e9, "self_maxrss_gb": hwm / 1e9,
            "children_maxrss_gb": children / 1e9, "tool_peak_gb": tool_peak[0] / 1e9}  # fmt: skip
    Path(result).write_text(json.dumps(row))


def _tool_hwm(process: Any) -> int:
    """The largest peak RSS (VmHWM) of the converter processes now running under ``process``:
    those of a tool environment (litert-torch's steps; onnx2tf and TensorFlow's), in bytes."""
    import psutil

    from quant.tflite import toolenv

    envs = tuple(str(env.dir()) for env in toolenv.ENVS.values())
    largest = 0
    for child in process.children(recursive=True):
        with contextlib.suppress(OSError, psutil.Error):
            if any(part.startswith(envs) for part in child.cmdline()[:1]):
                status = Path(f"/proc/{child.pid}/status").read_text().splitlines()
                for line in (ln for ln in status if ln.startswith("VmHWM:")):
                    largest = max(largest, int(line.split()[1]) * 1024)
    return largest


def _target_row(target: Any, input_dtype: str) -> dict[str, Any]:
    from quant.report.summary import precision_cell

    drift, vela, route = target.drift, target.vela, target.tflite_route
    one = next(
        (lat for lat in target.latency if lat.runtime == "litert" and lat.threads == 1), None
    )
    xnnpack = None
    if one is not None and one.xnnpack_ops is not None:
        xnnpack = [sum(t for _, t in one.xnnpack_ops.values()),
                   sum(n for n, _ in one.xnnpack_ops.values())]  # fmt: skip
    return {
        "status": target.status, "error": target.error, "vision": input_dtype.startswith("float"),
        "route_taken": route and route.name, "route_reason": route and route.reason,
        "agreement": drift and drift.agreement, "top1_drop_pts": drift and drift.top1_drop_pts,
        "cosine": drift and drift.cosine, "npu_ops": vela and vela.npu_ops,
        "cpu_ops": vela and list(vela.cpu_ops), "vela_cycles": vela and vela.cycles,
        "vela_est_ms": vela and vela.est_ms, "xnnpack_taken": xnnpack,
        "p50_ms_1t": one and one.p50_ms, "latency_others_busy": one and one.others_busy_cores,
        "fallback_ops": target.fallback_ops,
        "tool_convert_s": route and route.convert_s, "tool_quantize_s": route and route.quantize_s,
        "precision": precision_cell(target),
    }  # fmt: skip


def _other_target(target: Any) -> dict[str, Any]:
    """Another target's status and the shipped file's drift (the build's time is imx93's)."""
    from quant.report.summary import precision_cell

    drift = target.drift
    return {"status": target.status, "error": target.error,
            "agreement": drift and drift.agreement, "top1_drop_pts": drift and drift.top1_drop_pts,
            "precision": precision_cell(target)}  # fmt: skip


def _busy_s() -> float:
    """Seconds the host's cores have been busy (all processes) since boot."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def measure(
    model: Path,
    route: str,
    work: Path,
    data: tuple[Path, Path] | None,
    bars: str = "on",
    targets: str = "imx93",
) -> dict:
    """One route on one model, in a fresh process; what other work did on the host meanwhile."""
    work.mkdir(parents=True)
    result, log = work / "row.json", work / "worker.log"
    code = (
        "import sys; from benchmarks.conversion.tflite_routes import worker; worker(*sys.argv[1:])"
    )
    args = [sys.executable, "-c", code, str(model), str(work / "out"), str(result)]
    args += [str(p) for p in data or ("", "")] + [bars, targets]
    env = {**os.environ, "EDGE_UN_TFLITE_ROUTE": route}
    ours = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy, started = _busy_s(), time.perf_counter()
    with log.open("w") as output, contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(args, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                       timeout=WORKER_TIMEOUT_S, check=False)  # fmt: skip
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    ours_s = after.ru_utime + after.ru_stime - ours.ru_utime - ours.ru_stime
    if result.is_file():
        row = json.loads(result.read_text())
    else:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        row = {"status": "failed", "error": f"worker died: {lines[-1] if lines else wall}"}
    others = max(0.0, (_busy_s() - busy - ours_s) / wall)
    return {"route": route, **row, "wall_s": wall, "others_busy_cores": round(others, 2)}


def _rows_for(
    name: str,
    form: str,
    group: str,
    model: Path,
    work: Path,
    data: Any,
    bars: str = "on",
    targets: str = "imx93",
) -> list:
    rows = []
    for route in ROUTES:
        head = {"group": group, "model": name, "form": form, "bars": bars}
        if form == "onnx" and route == "litert-torch":
            rows.append({**head, "route": route, "status": "n/a", "error": NOT_APPLICABLE})
            continue
        rows.append({**head, **measure(model, route, work / f"{form}-{route}", data, bars,
                                       targets)})  # fmt: skip
        row = rows[-1]
        print(
            f"{name} {form} {route}: {row['status']}, build {row.get('build_s') or 0:.0f} s, "
            f"wall {row['wall_s']:.0f} s, {row.get('error') or ''}"[:200],
            flush=True,
        )
    return rows


def run(only: str | None = None, note: str | None = None) -> dict[str, Any]:
    from edge_un import examples
    from quant.host import describe_host
    from quant.report import Host

    previous = RESULTS / f"{NAME}.json"
    earlier = json.loads(previous.read_text()) if only and previous.is_file() else {"rows": []}
    rows = [r for r in earlier["rows"] if r["group"] != only]
    for row in rows:  # a row from before rows said where they were measured: its run's
        row.setdefault("host", Host(**earlier["host"]).label())
        row.setdefault("commit", earlier["commit"])
    commit, uncommitted = git_commit(), _uncommitted()  # the code measured: as the run starts
    here, kept = describe_host(), len(rows)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        if only in (None, "bundled"):
            for name in BUNDLED:
                path = examples.path(name)
                form = "directory" if path.is_dir() else path.suffix.lstrip(".")
                rows += _rows_for(name, form, "bundled", path, work / name, None)
        if only in (None, "families"):
            from testbed import hf_families

            for family in hf_families.FAMILIES:
                (work / family).mkdir()
                model = hf_families.build(family)
                data = hf_families.write_data(model, work / family)
                feeds = hf_families.user_feeds(model, 1, 7)
                forms = hf_families.export_as_users_do(model, feeds, work / family)
                for form, path in forms.items():
                    rows += _rows_for(family, form, "families", path, work / family, data)
        if only in (None, "trained"):
            for name, path in trained_models(work).items():
                rows += _rows_for(name, "directory", "trained", path, work / name, None,
                                  targets=TRAINED_TARGETS)  # fmt: skip
        if only in (None, "scale"):
            from testbed import hf_families

            for name, make in SCALE.items():
                (work / name).mkdir()
                model = make()
                data = hf_families.write_data(model, work / name)
                feeds = hf_families.user_feeds(model, 1, 7)
                path = hf_families.export_as_users_do(model, feeds, work / name, ["directory"])
                del model  # the worker loads its own copy: not two in memory at once
                rows += _rows_for(name, "directory", "scale", path["directory"], work / name,
                                  data, bars="off")  # fmt: skip
    for row in rows[kept:]:
        row |= {"host": here.label(), "commit": commit + "+" * uncommitted}
    return {"rows": rows, "host": here.model_dump(), "commit": commit,
            "uncommitted": uncommitted, "run_s": time.perf_counter() - started, "rerun": only,
            "note": note, "load_average_at_end": os.getloadavg()}  # fmt: skip


def trained_models(work: Path) -> dict[str, Path]:
    """The trained group's directories, each made once (kept in $EDGE_UN_BENCH_TEACHERS when it
    is set): two trainings at a time, one thread each."""
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.conversion import hf_families_trained
    from benchmarks.training.hf_migrate import CLI, TEACHERS, made_once
    from edge_un import examples

    kept = TEACHERS or work
    plain = kept / "hf-vit-un-plain"
    migrate = [*CLI, "migrate", str(examples.path("hf-vit-mnist-ln")), "--seed", "0",
               "--threads", "1", "--out", str(plain)]  # fmt: skip
    families = [name for name in TRAINED if name in hf_families_trained.MODELS]
    with ThreadPoolExecutor(max_workers=2) as pool:  # one training per core
        made = pool.map(lambda model: hf_families_trained.prepare(model, work), families)
        made_once("hf-vit-un-plain", {"migrated": plain}, {"migrate": migrate}, work)
        chains = dict(zip(families, made, strict=True))
    return {"hf-vit-un-plain": plain, **{m: c["paths"]["int8_ready"] for m, c in chains.items()}}


def _scaled(family: str) -> Any:
    """A base-size HF model (its default config), UN swapped in, trained-looking norm
    statistics, random weights otherwise."""
    import edge_un
    from testbed import hf_families

    transformers = edge_un.hf.require_transformers()
    model_class, config_class = {
        "bert-base": ("BertForSequenceClassification", "BertConfig"),
        "vit-b16": ("ViTForImageClassification", "ViTConfig"),  # 224 x 224, patch 16
    }[family]
    config = getattr(transformers, config_class)(num_labels=2)
    model = getattr(transformers, model_class)(config)
    edge_un.swap_layernorm(model, kind="un")
    return hf_families.randomize_norm_state(model, 0).eval()


SCALE = {name: functools.partial(_scaled, name) for name in ("bert-base", "vit-b16")}


def _uncommitted() -> bool:
    """Whether the tracked code measured differs from HEAD (read only: no index refresh); the
    results of a group run just before (this benchmark's own files) are not code."""
    diff = ["git", "--no-optional-locks", "diff", "--quiet", "HEAD", "--", ".",
            ":(exclude)benchmarks/results"]  # fmt: skip
    return subprocess.run(diff, cwd=ROOT, check=False).returncode != 0


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--only", choices=GROUPS)
    parser.add_argument("--note", help="a sentence for the results: how or where it ran")
    args, rest = parser.parse_known_args()
    sys.argv[1:] = rest
    benchmark_main(NAME, __doc__, functools.partial(run, args.only, args.note), markdown, plot)


if __name__ == "__main__":
    main()
