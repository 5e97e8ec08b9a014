import sys, os
sys.path.insert(0, os.path.join(os.getcwd(), "experiments/bench"))
import jax, jax.numpy as jnp, jaxopt
from peers import deq_problem, deq_map, f32, ours_fixed, jaxopt_contenders, S
from _compare import interleaved
W, U, b, x, w_out = deq_problem(0)
Wf, Uf, bf, xf, wf = f32(W, U, b, x, w_out)
d = 256; tol = 1e-5
rule = dict(tol=tol, max_steps=200, norm=S.l2_norm)
def make(solve, grad=True):
    def loss(W, U, b):
        z = jax.vmap(lambda xi: solve(lambda z, W, U, b, xi: deq_map(z, W, U, b, xi), jnp.zeros(d), W, U, b, xi)[0])(xf)
        return jnp.sum(z @ wf)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))) if grad else jax.jit(loss)
jfpi = jaxopt_contenders(jaxopt, tol, 200, ("picard",))["jaxopt FixedPointIteration"]
c = {
 "ours default (anderson richardson + auto fallback)": ours_fixed(S.Picard(**rule), S.Implicit()),
 "ours no fallback": ours_fixed(S.Picard(**rule), S.Implicit(fallback=None)),
 "ours picard richardson, no fallback": ours_fixed(S.Picard(**rule), S.Implicit(linear_solver=S.Picard(), fallback=None)),
 "ours gmres20, no fallback": ours_fixed(S.Picard(**rule), S.Implicit(linear_solver=S.GMRES(restart=20), fallback=None)),
 "ours onestep": ours_fixed(S.Picard(**rule), S.OneStep()),
 "jaxopt fpi": jfpi,
}
fns = {k: make(f) for k, f in c.items()}
fns["ours FWD only"] = make(c["ours no fallback"], False)
fns["jaxopt FWD only"] = make(jfpi, False)
t = interleaved({k: (lambda g=g: g(Wf, Uf, bf)) for k, g in fns.items()}, 21)
print(jax.devices())
for k in fns: print(f"{k:>52} {t.median(k)*1e3:8.2f} ms")
