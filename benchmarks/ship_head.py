"""Copy a trained head (``heterospec train-draft --out``) into the package as the shipped default head:
floating-point weights cast to float16 (d2t/t2d kept), config.json and training_log.json copied, and
PROVENANCE.md written from the given command, data and machine notes plus the training log.

    python benchmarks/ship_head.py SRC_DIR [--dst heterospec/data/smollm2-135m-instruct-eagle3]
        --command "heterospec train-draft ..." --data "..." --machine "..." [--note "..."]
"""
import argparse
import hashlib
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

DEFAULT_DST = os.path.join(os.path.dirname(__file__), "..", "heterospec", "data", "smollm2-135m-instruct-eagle3")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("--dst", default=DEFAULT_DST)
    ap.add_argument("--command", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--note", action="append", default=[])
    a = ap.parse_args()
    os.makedirs(a.dst, exist_ok=True)
    sd = load_file(os.path.join(a.src, "model.safetensors"))
    sd = {k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
    out = os.path.join(a.dst, "model.safetensors")
    save_file(sd, out, metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(a.src, "config.json")))
    cfg["torch_dtype"] = "float16"
    json.dump(cfg, open(os.path.join(a.dst, "config.json"), "w"), indent=1)
    log = json.load(open(os.path.join(a.src, "training_log.json")))
    shutil.copy(os.path.join(a.src, "training_log.json"), os.path.join(a.dst, "training_log.json"))
    curves = os.path.join(a.src, "training_curves.png")
    if os.path.exists(curves):
        shutil.copy(curves, os.path.join(a.dst, "training_curves.png"))
    sha = hashlib.sha256(open(out, "rb").read()).hexdigest()
    settings = {k: v for k, v in log.items() if k not in ("log", "val_log")}
    last = log["log"][-1] if log.get("log") else None
    best = [r for r in log.get("val_log") or [] if r[0] == log.get("best_val_step")]
    lines = [
        "# Provenance of the shipped EAGLE-3 head for SmolLM2-135M-Instruct", "",
        "Trained by heterospec itself (`heterospec train-draft`) on the target's own greedy answers; "
        "the benchmark prompts were never used.", "",
        "## Command", "", "```bash", a.command, "```", "",
        "## Data", "", a.data, "",
        "## Machine", "", a.machine, "",
        "## Training settings (training_log.json)", "", "```json", json.dumps(settings, indent=1), "```", "",
        f"Last logged step: {last[0]}, loss {last[1]:.3f}, accuracy per unrolled step "
        f"{', '.join(f'{x:.2f}' for x in last[2])}." if last else "", "",
        (f"Shipped: the head of step {best[0][0]}, the lowest validation loss ({best[0][1]:.3f}; accuracy per "
         f"unrolled step on the held-out sequences {', '.join(f'{x:.2f}' for x in best[0][2])}). The loss and "
         "accuracy curves are in `training_curves.png`.") if best else "", "",
        "## Files", "",
        f"- `model.safetensors`: float16 (cast from the float32 checkpoint), {os.path.getsize(out) / 2**20:.1f} MiB, "
        f"sha256 `{sha}`; the token embedding is not stored (it is the target's, shared at load).",
        "- `config.json`: the SafeAILab EAGLE-3 layout that `Eagle3Draft.from_pretrained` loads.",
        "- `training_log.json`: settings and the logged (step, loss, accuracy per unrolled step), training and "
        "validation.",
        "- `training_curves.png`: those curves drawn (when the run wrote them).",
        "- `profile.json`: the calibrated HeteroSpec policy (`heterospec calibrate`), when present.", "",
    ]
    if a.note:
        lines += ["## Notes", ""] + [f"- {n}" for n in a.note] + [""]
    open(os.path.join(a.dst, "PROVENANCE.md"), "w").write("\n".join(lines))
    print(f"shipped {a.src} -> {a.dst} ({os.path.getsize(out) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
