"""A small Nelder-Mead minimiser, so that fitting needs no SciPy."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def nelder_mead(
    f: Callable[[list[float]], float],
    x0: Sequence[float],
    steps: Sequence[float],
    iters: int = 2000,
    tol: float = 1e-12,
) -> list[float]:
    """Minimise f from x0 with the Nelder-Mead simplex (no SciPy here)."""

    def along(centre: list[float], worst: list[float], t: float) -> list[float]:
        return [c + t * (w - c) for c, w in zip(centre, worst, strict=True)]

    simplex = [list(x0)]
    for i, step in enumerate(steps):
        vertex = list(x0)
        vertex[i] += step
        simplex.append(vertex)
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centre = [sum(c) / (len(simplex) - 1) for c in zip(*simplex[:-1], strict=True)]
        worst = simplex[-1]
        refl = along(centre, worst, -1.0)
        f_refl = f(refl)
        if f_refl < values[0]:
            exp = along(centre, worst, -2.0)
            f_exp = f(exp)
            simplex[-1], values[-1] = (exp, f_exp) if f_exp < f_refl else (refl, f_refl)
        elif f_refl < values[-2]:
            simplex[-1], values[-1] = refl, f_refl
        else:
            contr = along(centre, worst, 0.5)
            f_contr = f(contr)
            if f_contr < values[-1]:
                simplex[-1], values[-1] = contr, f_contr
            else:  # shrink towards the best vertex
                simplex = [simplex[0]] + [along(simplex[0], s, 0.5) for s in simplex[1:]]
                values = [values[0]] + [f(s) for s in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]
