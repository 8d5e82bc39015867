"""The quantization attack: the probes again with the weights rounded to each bit width (round-to-nearest here, or
bitsandbytes' int8 / nf4 kernels), as `quantization.<bits>` and `q<bits>_<probe>` (q4_forget_es, q4_mc_world_forget)
beside the unattacked numbers (the rounding: `quantize.py`)."""

from __future__ import annotations

import logging

from pipeline.evaluation import registry
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluator import Context, Evaluator, Part
from pipeline.evaluation.probes import probe
from pipeline.evaluation.quantize import load_quantized_bnb, resolve_method, rtn_quantized

log = logging.getLogger(__name__)


class Quantization(Evaluator):
    name, benchmark = "quantization", registry.QUANTIZATION

    def enabled(self, cfg: EvalConfig) -> bool:
        return cfg.quantize_spec is not None

    def run(self, model, ctx: Context) -> Part:
        cfg, inputs, spec = ctx.cfg, ctx.inputs, ctx.cfg.quantize_spec
        method = resolve_method(spec.method)
        summary = {"quantization": {"method": method, "group_size": spec.group_size}}
        for bits in spec.bits:
            if method == "rtn":
                with rtn_quantized(model, bits, spec.group_size) as report:
                    probed = probe(model, ctx.tokenizer, ctx.template, inputs.tofu, inputs.mc, cfg)
            else:  # bitsandbytes: the weights reloaded into its int8 / nf4 kernels
                quantized = load_quantized_bnb(ctx.model_path, bits, cfg.trust_remote_code)
                report = {"method": "bnb", "bits": bits}
                probed = probe(quantized, ctx.tokenizer, ctx.template, inputs.tofu, inputs.mc, cfg)
                del quantized
            summary["quantization"][str(bits)] = {**probed, "weights": report}
            summary.update({f"q{bits}_{key}": value for key, value in probed.items()})
            log.info("q%d (%s): %s", bits, method, probe_line(probed))  # as the summary's q8_ keys
            log.debug("quantization attack, %d bits (%s): %s", bits, method, probed)
        return Part(summary)


def probe_line(probed: dict) -> str:
    """A probe's headline numbers, for the log: forget ES (of the paraphrased questions too), retain ES and each
    multiple-choice accuracy."""
    parts = [f"{registry.label(key)} {probed[key]:.3f}" for key in ("forget_es", "forget_para_es", "retain_es")
             if key in probed]
    mc = [f"{key.removeprefix('mc_')} {value:.3f}" for key, value in probed.items() if key.startswith("mc_")]
    return ", ".join(parts + (["MC " + ", ".join(mc)] if mc else []))
