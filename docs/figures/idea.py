"""Draws docs/figures/idea.png: one spin-attention layer on 8 tokens, its inputs as fields, its
couplings, and its outputs as the magnetizations of the steady state.

    python docs/figures/idea.py
"""

import pathlib

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from spinformer import nn  # noqa: E402

n, d = 8, 3
attn = nn.SpinAttention(d, num_heads=1, output_proj=False, key=jax.random.key(3))
x = jax.random.normal(jax.random.key(4), (n, d))
m, diag = attn(x, return_diagnostics=True)
h = np.asarray(diag.fields)[0] if np.asarray(diag.fields).ndim == 3 else np.asarray(diag.fields)
mag = np.asarray(diag.magnetizations)
mag = mag[0] if mag.ndim == 3 else mag
J = np.asarray(diag.couplings)
J = J[0] if J.ndim == 3 else J

fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
for ax, vec, title in ((axes[0], h, "inputs: fields $h_i$ on the spins"),
                       (axes[2], mag, "outputs: magnetizations $m_i$")):
    for i in range(n):
        ax.arrow(i, 0, 0.9 * vec[i, 0] / (np.abs(vec[:, :2]).max() + 1e-9),
                 0.9 * vec[i, 1] / (np.abs(vec[:, :2]).max() + 1e-9), width=0.04,
                 color=f"C{i}", length_includes_head=True)
    ax.set_xlim(-1, n)
    ax.set_ylim(-1.1, 1.1)
    ax.set_xticks(range(n))
    ax.set_xlabel("token i (first two of the d = 3 components drawn)")
    ax.set_yticks([])
    ax.set_title(title, fontsize=10)
im = axes[1].imshow(J, cmap="viridis")
axes[1].set_title("couplings $J_{ij}$ = softmax$_j(q_i\\cdot k_j/\\sqrt{d})$", fontsize=10)
axes[1].set_xlabel("j")
axes[1].set_ylabel("i")
fig.colorbar(im, ax=axes[1], fraction=0.046)
fig.suptitle(f"One spin-attention layer: the TAP steady state of {n} coupled vector spins "
             f"({int(np.max(diag.solver.num_steps))} Anderson steps)", fontsize=11)
fig.tight_layout()
out = pathlib.Path(__file__).with_suffix(".png")
fig.savefig(out, dpi=110)
print(out)
