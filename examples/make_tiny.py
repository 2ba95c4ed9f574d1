"""Regenerate examples/tiny-llama: a real Llama checkpoint (random weights, 4 layers, GQA 8:2)
written by transformers' own save_pretrained. Run: python examples/make_tiny.py"""

from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests._models import make_checkpoint  # noqa: E402

if __name__ == "__main__":
    out = Path(__file__).resolve().parent / "tiny-llama"
    make_checkpoint("llama", out, seed=1234)
    print(f"wrote {out}")
