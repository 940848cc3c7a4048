"""``vcluster bench gpu-decode``: one layer of a model's decode and prefill steps timed with
PyTorch on this machine's GPU, written into a hardware file whose serving cost model
prices that layer from them.

The measurement is :func:`vcluster.gpu.decode_step.measure_layer_steps` (plain PyTorch,
bf16, one layer of ``--model`` as one GPU of ``--tp`` holds it: decode B ∈ {1, 8, 32, 128}
× context C ∈ {512, 2048, 8192}, prefill T ∈ {128, 512, 2048, 8192}; points that do not
fit the GPU's memory are skipped and named). The file
(:func:`~vcluster.gpu.decode_step.layer_steps_hardware`) is ``--base`` — a preset (default:
the preset of the GPU's name) or a hardware file, e.g. one from ``vcluster hardware
calibrate --gpu`` — with the rows added to ``device.kernels`` as ``decode_layer`` and
``prefill_layer`` rows; :class:`~vcluster.timing.serving.step_cost.ServingCostModel` on it
prices every layer of that shape from them (docs/serving.md, "Measured layer steps"). ``--device
cpu`` runs the same code on the CPU at tiny sizes (fp32): a test of the path, not GPU
calibration. Without CUDA (and without ``--device cpu``) it exits 2 and says so.
"""

from __future__ import annotations

import sys

from .args import positive_int

__all__ = ["add_parser", "run_gpu_decode"]


def add_parser(kinds) -> None:
    gd = kinds.add_parser(
        "gpu-decode", help="time one layer's decode and prefill steps on this GPU into a "
                           "hardware file the serving model prices from",
        description="Median seconds per layer of a model's decode steps (B sequences x C "
                    "context) and prefill steps (T tokens) in plain PyTorch on the local "
                    "CUDA GPU, written as decode_layer / prefill_layer rows into a hardware "
                    "file; vcluster's serving cost model on that file prices layers of the "
                    "same shape from them. Needs CUDA (--device cpu: the same code on the "
                    "CPU at tiny sizes, not GPU calibration).")
    gd.add_argument("--model", required=True,
                    help="a model preset (vcluster model list) or a Hugging Face config.json")
    gd.add_argument("--out", required=True, metavar="FILE", help="the hardware YAML to write")
    gd.add_argument("--base", default=None, metavar="PRESET_OR_FILE",
                    help="the hardware the rows are added to: a preset, or a hardware YAML "
                    "file such as one from hardware calibrate --gpu (default: the preset of "
                    "this GPU's name; h100-dgx with --device cpu)")
    gd.add_argument("--tp", type=positive_int, default=1,
                    help="time one GPU's shard of the layer at this tensor-parallel degree "
                    "(heads, KV heads and MLP width over tp; the all-reduces are priced "
                    "apart) (1)")
    gd.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default), or cpu: the same code at tiny sizes, to test it")
    gd.add_argument("--name", default=None,
                    help="the file's hardware name (default: the base file's, else "
                    "<device>-calibrated-<date>)")
    gd.add_argument("--repeats", type=positive_int, default=None,
                    help="timed streams per point, the median kept (5 on a GPU, 3 on the "
                    "CPU)")
    gd.set_defaults(run=run_gpu_decode)


def run_gpu_decode(args) -> int:
    # lazy: keeps vcluster --help fast (torch, the model layer)
    from modeling import load_model
    from vcluster.gpu.calibration import check_name, default_base
    from vcluster.gpu.decode_step import layer_steps_hardware, measure_layer_steps
    from vcluster.gpu.kernel_sweep import cuda_missing, torch_missing
    from vcluster.runtime.files import write_text_atomic
    from vcluster.timing import PRESET_NAMES, load_hardware
    from vcluster.timing.serving.measured_steps import measured_layer_steps

    from .hardware_cmd import checked_out
    spec = load_model(args.model)                                  # checks first
    if args.name is not None:
        check_name(args.name, "--name")
    out = checked_out(args.out)
    base_doc = _base_document(args.base, PRESET_NAMES) if args.base else None
    if why := torch_missing():
        print(f"vcluster bench gpu-decode: {why}", file=sys.stderr)
        return 2
    if args.device == "cuda" and (why := cuda_missing()):
        print(f"vcluster bench gpu-decode needs a CUDA GPU: {why}; --device cpu runs the "
              "same code on the CPU at tiny sizes (a test of the path, not GPU calibration)",
              file=sys.stderr)
        return 2
    cpu = args.device == "cpu"
    repeats = args.repeats or (3 if cpu else 5)
    print(f"vcluster bench gpu-decode: one {spec.name} layer at tp {args.tp} on "
          f"{args.device}{' (tiny sizes)' if cpu else ''} ...", file=sys.stderr, flush=True)
    sweep = measure_layer_steps(spec, tp=args.tp, device=args.device, repeats=repeats)
    if base_doc is None:
        base_doc = default_base(sweep.device_name) or ("h100-dgx" if cpu else None)
        if base_doc is None:
            raise ValueError(f"no preset is a {sweep.device_name!r}: name the hardware the "
                             f"rows are added to with --base ({', '.join(PRESET_NAMES)}, "
                             "or a hardware file)")
    document = layer_steps_hardware(sweep, base_doc, name=args.name)
    print(f"{sweep.device_name}, torch {sweep.torch_version}, {sweep.dtype}: one layer "
          f"[{sweep.layer}], median of {sweep.repeats} streams per point")
    if cpu:
        print("CPU figures are not GPU calibration: they test the code path (fp32 rows, "
              "which only an fp32 serving model with 4-byte weights and cache uses)")
    hw = load_hardware(document)
    fits, unfit = measured_layer_steps(hw.device.kernels)
    fit = fits.get((sweep.layer, sweep.dtype))
    print(_table(sweep, fit, _analytic(spec, hw, args.tp, sweep.dtype)))
    for line in sweep.skipped:
        print(f"skipped {line}")
    for line in sweep.notes:
        print(f"note: {line}")
    if fit is None:
        print(f"warning: the serving cost model prices this layer analytically: "
              f"{unfit.get((sweep.layer, sweep.dtype), 'no rows')}", file=sys.stderr)
    else:
        print(f"fitted (DistServe's forms): {fit!r}")
    import yaml
    header = (f"# {document['name']}: {document['source']}\n"
              f"# use it: vcluster simulate serve ... --hardware {out.name}\n")
    write_text_atomic(str(out), header + yaml.safe_dump(document, sort_keys=False))
    print(f"wrote {out}; use it with --hardware {out}")
    return 0


def _base_document(base: str, presets) -> str | dict:
    """``--base``: a preset's name, or the hardware document a YAML file holds."""
    if base in presets:
        return base
    from pathlib import Path

    import yaml
    path = Path(base)
    if not path.is_file():
        raise ValueError(f"--base = {base!r}: not a preset ({', '.join(presets)}) nor a "
                         "hardware file")
    try:
        doc = yaml.safe_load(path.read_text("utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"--base = {base!r}: not valid YAML: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("base"), str):
        raise ValueError(f"--base = {base!r}: a hardware file starting from a preset "
                         f"('base: <preset>'), as hardware calibrate --gpu writes, is needed")
    return doc


def _analytic(spec, hw, tp: int, dtype: str):
    """``rows -> seconds``: one layer's compute (GEMMs, attention, elementwise) as the
    analytic serving model prices it on ``hw`` without measured layer steps — a model of
    two layers less one of one layer, so the embedding, final norm, head, communication
    and overhead cancel."""
    import dataclasses

    # lazy: keeps vcluster --help fast
    from vcluster.timing.kernel_profile import LAYER_STEP_KINDS
    from vcluster.timing.serving.step_cost import ServingCostModel
    device = dataclasses.replace(hw.device, kernels=tuple(
        r for r in hw.device.kernels if r.kind not in LAYER_STEP_KINDS))
    plain = dataclasses.replace(hw, device=device)
    size = 2 if dtype == "fp32" else 1                 # fp32 weights and cache on the CPU
    models = [ServingCostModel(spec.with_layers(n), plain, tp=tp, dtype=dtype,
                               weight_bytes_per_param=2 * size,
                               kv_bytes_per_element=2 * size) for n in (1, 2)]

    def layer_s(rows):
        one, two = (m.step_time(rows) for m in models)
        return sum(getattr(two, f) - getattr(one, f)
                   for f in ("gemm_s", "attention_s", "elementwise_s"))
    return layer_s


def _table(sweep, fit, analytic) -> str:
    """Each measured point (ms per layer per step) beside the fit's price and the analytic
    model's on the file's hardware, with their errors against the measurement."""
    def cells(seconds, rows, fitted):
        out = f"{seconds * 1e3:>11.4f}"
        for got in ((fitted,) if fit is not None else ()) + (analytic(rows),):
            out += f"{got * 1e3:>11.4f}{100 * (got / seconds - 1):>+7.1f}%"
        return out
    head = f"{'step':<20}{'measured':>11}" + (f"{'fit':>11}{'':>8}" if fit is not None
                                              else "") + f"{'analytic':>11}{'':>8}"
    lines = [head + "   (ms per layer)"]
    for b, c, seconds in sweep.decode:
        fitted = fit.step_s(b, b * c, 0, 0) if fit is not None else None
        lines.append(f"{f'decode {b}x{c}':<20}" + cells(seconds, [(1, c)] * b, fitted))
    for t, seconds in sweep.prefill:
        fitted = fit.step_s(0, 0, t, t * t) if fit is not None else None
        lines.append(f"{f'prefill {t}':<20}" + cells(seconds, [(t, t)], fitted))
    return "\n".join(lines)
