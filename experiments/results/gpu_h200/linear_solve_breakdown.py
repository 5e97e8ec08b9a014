import sys, os
sys.path.insert(0, os.path.join(os.getcwd(), "experiments/bench"))
import jax, jax.numpy as jnp
from peers import deq_problem, deq_map, f32, S
from spinformer.solvers._linear import richardson_solve, linear_solve
from _compare import interleaved
W, U, b, x, w_out = deq_problem(0)
Wf, Uf, bf, xf, wf = f32(W, U, b, x, w_out)
# fixed points (float32, many Picard steps)
def fp(xi):
    z = jnp.zeros(256)
    for _ in range(60): z = deq_map(z, Wf, Uf, bf, xi)
    return z
Z = jax.jit(jax.vmap(fp))(xf)
def mk(kind):
    def one(z, xi):
        _, vjp = jax.vjp(lambda z: deq_map(z, Wf, Uf, bf, xi), z)
        mv = lambda v: v - vjp(v)[0]
        if kind == "ours linear_solve picard":
            return linear_solve(S.Picard(), mv, wf, rtol=1e-5, max_steps=200)[0]
        if kind == "ours linear_solve anderson":
            return linear_solve(S.Anderson(history=5, safeguard=False), mv, wf, rtol=1e-5, max_steps=200)[0]
        if kind == "ours richardson picard only":
            return richardson_solve(S.Picard(), mv, wf, rtol=1e-5, max_steps=200)[0]
        if kind == "plain while picard":
            tol = 1e-5 * jnp.linalg.norm(wf)
            def cond(c): return (c[2] > tol) & (c[1] < 200)
            def body(c):
                w, k, _ = c; r = wf - mv(w); return w + r, k + 1, jnp.linalg.norm(r)
            return jax.lax.while_loop(cond, body, (wf, 0, jnp.inf))[0]
        if kind == "jax cg normal":
            from jax.scipy.sparse.linalg import cg
            _, vjp2 = jax.vjp(mv, z)  # (I-J) v
            fwd = lambda v: jax.jvp(lambda z: deq_map(z, Wf, Uf, bf, xi), (z,), (v,))[1]
            A = lambda v: v - fwd(v)
            return cg(lambda v: mv(A(v)), mv(wf), tol=1e-5)[0]
    return jax.jit(jax.vmap(one))
kinds = ["ours linear_solve picard", "ours linear_solve anderson", "ours richardson picard only", "plain while picard", "jax cg normal"]
fns = {k: mk(k) for k in kinds}
t = interleaved({k: (lambda f=f: f(Z, xf)) for k, f in fns.items()}, 21)
print(jax.devices())
for k in kinds: print(f"{k:>32} {t.median(k)*1e3:8.3f} ms")
