"""The one conversion pipeline: load, fold, export per target, quantize, compile, measure, report.

``convert`` is what ``edge-un convert`` and the HTTP service both run. It is three kinds of
step, which also run one by one, in other processes or on other machines that share the job's
directories (the service's Celery workers): :func:`~quant.prepare.prepare` (one load and one
fold, then one ONNX export per distinct opset/batch the targets need, on the fp32 conversion of
:mod:`converters.fold_and_export`), :func:`build_target` for each target (in a child process of its
own, ``quant.isolation``), and :func:`assemble`, which writes ``report.json`` and ``report.md``
beside the artifacts in ``out_dir``. ``convert`` is exactly these steps (its targets' builds one
after another, or ``parallel`` at once), so a report and its artifacts are the same however the
steps were spread. Progress comes as
:class:`~converters.ProgressEvent` values, each stage of a target's build tagged with the
target; the conversion's own fraction is the sum of its targets' (:func:`job_fraction`).
A target that fails (a converter crash, a rule its file breaks) is reported as failed with its
one-line reason; the other targets still complete (``Report.outcome`` says how it ended).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import edge_un
from converters.progress import Progress, ProgressEvent, ignore_progress
from converters.source import ModelSource

from .errors import Blame, blame, reason
from .host import describe_host
from .isolation import BuildOrder, build_in_child, builder_for, load_samples
from .job_files import Prepared, TargetPart, export_key, host_notes, load_part, save_part
from .measure.bars import DEFAULT_MAX_DRIFT, DEFAULT_MIN_AGREEMENT
from .prepare import prepare
from .quiet_latency import retime_contended
from .report import schema
from .report.records import artifact_record
from .report.summary import summary_markdown
from .request import ConversionRequest, conversion_request
from .targets.builder import TargetSettings
from .targets.profiles import Builder, TargetProfile

# The conversion's progress: what comes before the targets' builds, and where they end.
TARGETS_FROM, TARGETS_TO = 0.05, 0.95
# Why a target has no part when the caller gives no reason (its build never ended).
UNFINISHED = "its build did not finish"


def convert(
    model: ModelSource | str | Path,
    targets: str | Sequence[TargetProfile | str] | None = None,
    calib: str | Path | None = None,
    eval: str | Path | None = None,  # the name for the evaluation data
    out_dir: str | Path = "edge-un-out",
    max_drift: float = DEFAULT_MAX_DRIFT,
    progress: Progress | None = None,
    *,
    config: str | Path | Mapping[str, Any] | None = None,
    min_agreement: float = DEFAULT_MIN_AGREEMENT,
    allow_online: bool = False,
    latency_runs: int = 100,
    recalibrate_batches: int = 0,
    deadline: float | None = None,
    parallel: int = 1,
) -> schema.Report:
    """Convert ``model`` for ``targets`` (profiles or their names, ``["cpu", "imx93"]`` or
    ``"cpu,imx93"``; default: every profile) into ``out_dir``. A path is
    read in the format its name says; the service passes the :class:`ModelSource` its upload
    checks established (its ``name`` is what the report calls the model).

    ``allow_online`` lets a LayerNorm model through (its norms stay: decomposed into int8 ops in
    TFLite, float in ORT), for comparisons; by default such a model is refused with the advice
    to migrate it. ``recalibrate_batches`` > 0 (a checkpoint with offline norms only) first
    recomputes every offline norm's inference statistics over that many batches of the
    calibration data (``calib``, else the checkpoint's training split) with
    :func:`edge_un.recalibrate`, then folds; the report's ``recalibration`` says how it went.
    ``deadline`` (``time.time()``; None: none) is when every target's build must be done: a
    search for a file within the bars that cannot finish by then ships its best file so far.
    ``parallel``: how many targets build at once, each in its process (their memory adds up);
    the report is the same either way.
    """
    request = conversion_request(
        model, targets, calib, eval, config=config, max_drift=max_drift,
        min_agreement=min_agreement, allow_online=allow_online, latency_runs=latency_runs,
        recalibrate_batches=recalibrate_batches,
    )  # fmt: skip
    return run_conversion(request, out_dir, progress, deadline=deadline, parallel=parallel)


def run_conversion(
    request: ConversionRequest,
    out_dir: str | Path,
    progress: Progress | None = None,
    *,
    deadline: float | None = None,
    parallel: int = 1,
) -> schema.Report:
    """The whole conversion ``request`` asks for into ``out_dir`` (:func:`convert` says what
    ``deadline`` and ``parallel`` mean): prepared once, each target built, then assembled."""
    say = progress or ignore_progress
    with tempfile.TemporaryDirectory(prefix="edge-un-work-") as work:
        prepared = prepare(request, Path(out_dir).resolve(), Path(work), say)
        if parallel > 1:
            _build_at_once(prepared, say, deadline, parallel)
        else:
            count = len(prepared.targets)
            for index, name in enumerate(prepared.targets):
                build_target(prepared, name, _in_sequence(say, index, count), deadline)
        return assemble(prepared, progress=say, deadline=deadline)


def job_fraction(fractions: Sequence[float]) -> float:
    """The conversion's progress from its targets' (each 0 to 1, their builds' own): the sum
    of theirs over the span the builds take, whether they run one after another or at once."""
    share = sum(min(max(f, 0.0), 1.0) for f in fractions) / max(len(fractions), 1)
    return TARGETS_FROM + (TARGETS_TO - TARGETS_FROM) * share


def _in_sequence(say: Progress, index: int, count: int) -> Progress:
    """A target's events as the conversion's, when the targets are built one after another:
    those before it done, those after it not started."""

    def target_event(event: ProgressEvent) -> None:
        done = [1.0] * index + [event.fraction] + [0.0] * (count - index - 1)
        say(ProgressEvent(event.stage, job_fraction(done), event.target, event.detail))

    return target_event


def _build_at_once(prepared: Prepared, say: Progress, deadline: float | None, workers: int) -> None:
    """Build the targets ``workers`` at a time (threads that each wait on a build's process),
    the conversion's progress the sum of theirs. A TFLite target that takes an earlier one's
    conversion of the same file (``quant.tflite.target``) would only wait for it, so such
    targets start last."""
    fractions = dict.fromkeys(prepared.targets, 0.0)
    lock = threading.Lock()  # one event at a time reaches the caller's callback

    def progress_of(name: str) -> Progress:
        def target_event(event: ProgressEvent) -> None:
            with lock:
                fractions[name] = event.fraction
                done = job_fraction(list(fractions.values()))
                say(ProgressEvent(event.stage, done, event.target, event.detail))

        return target_event

    with ThreadPoolExecutor(workers, thread_name_prefix="build") as pool:
        builds = [
            pool.submit(build_target, prepared, name, progress_of(name), deadline)
            for name in build_order([prepared.profile(n) for n in prepared.targets])
        ]
        for build in builds:
            build.result()


def build_order(profiles: Sequence[TargetProfile]) -> list[str]:
    """The targets in the order ``--parallel`` starts them: the longest builds first
    (``build_rank``), so that the last one to start is not the one the job waits for; those
    that reuse an earlier TFLite target's conversion last, since they would only wait for it."""
    leaders: list[TargetProfile] = []
    followers: list[str] = []
    converted: set[tuple[str, str]] = set()
    for profile in profiles:
        key = (profile.builder, export_key(profile.opset, profile.static_batch))
        if profile.builder is Builder.LITERT and key in converted:
            followers.append(profile.name)
        else:
            leaders.append(profile)
        converted.add(key)
    leaders.sort(key=build_rank, reverse=True)  # stable: ties keep the caller's order
    return [profile.name for profile in leaders] + followers


def build_rank(profile: TargetProfile) -> int:
    """How long a target's build takes, as a rank. Measured on BERT-base and ViT-B/16
    (benchmarks/results/hf_scale.md): a TFLite conversion (onnx2tf, then TensorFlow's
    converter) ~240 s, a power-of-two target (its stream search, bias correction) ~220 s, the
    cpu file ~130 s. Started in the order given (cpu and imx93 first), BERT-base's tda4vm
    ended the job 142 s after the last other target; longest first, cpu ended it, at the same
    8.9 min: on 2 cores both are busy throughout, and the order only tells where there are
    cores to spare (fewer workers than cores, more targets than workers)."""
    if profile.builder is Builder.LITERT:
        return 2
    return 1 if profile.power_of_two_scales else 0


def build_target(
    prepared: Prepared, name: str, progress: Progress | None = None, deadline: float | None = None
) -> schema.TargetReport:
    """Build target ``name`` of a prepared conversion in a process of its own, and leave its
    part for :func:`assemble`; any failure, a native crash included, fails this target only,
    with its one-line reason. Each stage is reported with the fraction of this target's own
    build. A build run again (its first run was lost) starts from an empty directory."""
    say = progress or ignore_progress
    profile = prepared.profile(name)
    target_dir = prepared.out_dir / name
    shutil.rmtree(target_dir, ignore_errors=True)
    target_dir.mkdir(parents=True)

    def stage(stage_name: str, fraction: float, detail: str | None = None) -> None:
        say(ProgressEvent(stage_name, fraction, target=name, detail=detail))

    export = prepared.export_of(profile)
    if isinstance(export, str):  # its fp32 export failed
        report = target_report(profile, schema.TargetResult(), error=export)
    else:
        settings = TargetSettings(
            profile=profile, bars=prepared.bars, fp32_path=export.path, target_dir=target_dir,
            out_dir=prepared.out_dir, latency_runs=prepared.latency_runs,
            shared_dir=prepared.work_dir / "shared", program=prepared.program,
            no_program=prepared.no_program,
        )  # fmt: skip
        order = BuildOrder(
            builder=builder_for(profile), settings=settings, deadline=deadline,
            calibration=prepared.calibration_dir, evaluation=prepared.evaluation_dir,
            reference=prepared.fp32_outputs,
        )  # fmt: skip
        try:
            result = build_in_child(order, prepared.work_dir / "builds" / name, stage)
        except MemoryError:
            raise  # the job's memory limit: said for the whole job (service.worker.steps)
        except Exception as error:  # one target's failure, whatever it is, loses no other's
            if blame(error) is Blame.BUG:
                traceback.print_exc()
            report = target_report(profile, schema.TargetResult(), error=reason(error))
        else:
            source = artifact_record(
                export.path, prepared.out_dir, "onnx", "folded fp32 ONNX it was quantized from"
            )
            result = result.model_copy(update={"artifacts": [*result.artifacts, source]})
            report = target_report(profile, result)
    save_part(prepared, TargetPart(report=report, host=describe_host()))
    return report


def assemble(
    prepared: Prepared,
    failures: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    deadline: float | None = None,
) -> schema.Report:
    """The report of a prepared conversion from its targets' parts, written as ``report.json``
    and ``report.md`` in its output directory. A target without a part failed: with the reason
    ``failures`` gives for it (e.g. its worker was lost every time), else :data:`UNFINISHED`.
    A latency figure timed while other builds ran is timed again first, now that they have
    ended, on a host like the one that timed it, where the builds' ``deadline``
    (``time.time()``; None: none) leaves the time (``quant.quiet_latency``)."""
    say = progress or ignore_progress
    reports: dict[str, schema.TargetReport] = {}
    hosts: dict[str, schema.Host] = {}
    for profile in prepared.profiles:
        part = load_part(prepared, profile.name)
        if part is None:
            reason = (failures or {}).get(profile.name, UNFINISHED)
            reports[profile.name] = target_report(profile, schema.TargetResult(), error=reason)
        else:
            reports[profile.name], hosts[profile.name] = part.report, part.host
    # timed again only on a host like the one that timed it (a Celery worker elsewhere is not)
    here = describe_host()
    busy = {
        name: reports[name]
        for name, host in hosts.items()
        if host == here and any(timing.contended() for timing in reports[name].latency)
    }
    if busy:
        say(ProgressEvent("latency", 0.96, detail="timed again, the other builds done"))
        reports |= retime_contended(
            busy, prepared.out_dir, lambda: load_samples(prepared.evaluation_dir).rows(0, 1),
            prepared.latency_runs, deadline,
        )  # fmt: skip
    say(ProgressEvent("report", 0.97))
    result = schema.Report(
        edge_un_version=edge_un.__version__,
        model=prepared.model,
        fold=prepared.fold,
        reference=prepared.reference,
        max_drift_pts=prepared.bars.max_drift,
        min_agreement=prepared.bars.min_agreement,
        targets=reports,
        notes=prepared.notes + host_notes(hosts),
        recalibration=prepared.recalibration,
        host=next(iter(hosts.values()), None) or here,
    )
    result.write(prepared.out_dir / schema.REPORT_FILE)
    (prepared.out_dir / schema.SUMMARY_FILE).write_text(summary_markdown(result))
    say(ProgressEvent("done", 1.0))
    return result


def target_report(
    profile: TargetProfile, result: schema.TargetResult, error: str | None = None
) -> schema.TargetReport:
    """A target's entry in the report: its profile's header, what its builder made and
    measured, and how it ended (failed with ``error``; else ok or over the drift bar)."""
    if error is not None:
        status = "failed"
    else:
        status = "ok" if result.drift is not None and result.drift.within_bar else "over_bar"
    header = {key: getattr(profile, key) for key in ("name", "board", "runtime", "opset")}
    rules = list(profile.rules)
    return schema.TargetReport(**header, rules=rules, status=status, error=error, **dict(result))
