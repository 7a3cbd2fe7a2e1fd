//! The per-layer router: one choice per KV head under a latency budget.
//!
//! Each head has options: dense (risk 0, the mass kept 1) and the sparse
//! candidates, each with a risk R, a lower mass bound m̲ and a kernel time
//! from the latency profile. Candidates with m̲ < τ are not eligible; a head
//! with none falls back to dense. The router starts from the lowest-risk
//! choice of every head (dense) and, while the layer's time (the probe's
//! and index builders' time plus every head's kernel time) exceeds the
//! budget, applies the substitution with the least added risk per
//! microsecond saved, over all heads and all of their cheaper eligible
//! options. It stops when the budget is met or nothing cheaper is left.

/// One option of one head.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub risk: f64,
    /// m̲ = max(0, m̂ − δ_q).
    pub lower: f64,
    /// Kernel time for this head, µs.
    pub time_us: f64,
}

/// The router's decision for a layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Per head, the index of the chosen option (0 is dense).
    pub choice: Vec<usize>,
    /// Per head, whether no sparse option was eligible.
    pub fallback: Vec<bool>,
    pub planned_us: f64,
    pub budget_us: f64,
    pub dense_us: f64,
}

impl Plan {
    pub fn within_budget(&self) -> bool {
        self.planned_us <= self.budget_us * (1.0 + 1e-9)
    }
}

/// Routes one layer. `heads[h][0]` must be dense; `budget` is the fraction of
/// dense time the layer may take, the fixed `overhead_us` (probe, index)
/// included.
pub fn route(heads: &[Vec<Choice>], budget: f64, overhead_us: f64, tau: f64) -> Plan {
    let dense_us: f64 = heads.iter().map(|o| o[0].time_us).sum();
    let budget_us = budget * dense_us;
    let eligible = |o: &Choice| o.lower >= tau;
    let fallback: Vec<bool> = heads.iter().map(|o| !o[1..].iter().any(eligible)).collect();
    let mut choice = vec![0; heads.len()];
    let mut planned_us = dense_us + overhead_us;
    while planned_us > budget_us {
        let mut best: Option<(f64, usize, usize)> = None;
        for (h, options) in heads.iter().enumerate() {
            let now = &options[choice[h]];
            for (i, o) in options.iter().enumerate().skip(1) {
                if !eligible(o) || o.time_us >= now.time_us {
                    continue;
                }
                let per_us = (o.risk - now.risk) / (now.time_us - o.time_us);
                if best.is_none_or(|(b, _, _)| per_us < b) {
                    best = Some((per_us, h, i));
                }
            }
        }
        let Some((_, h, i)) = best else { break };
        planned_us -= heads[h][choice[h]].time_us - heads[h][i].time_us;
        choice[h] = i;
    }
    Plan { choice, fallback, planned_us, budget_us, dense_us }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn option(risk: f64, lower: f64, time_us: f64) -> Choice {
        Choice { risk, lower, time_us }
    }

    /// A synthetic profile: dense 1000 µs a head; three sparse options at 40%,
    /// 20% and 10% of it, riskier as they get cheaper, with per-head risks.
    fn heads() -> Vec<Vec<Choice>> {
        (0..8)
            .map(|h| {
                let r = 0.01 * (h + 1) as f64;
                vec![
                    option(0.0, 1.0, 1000.0),
                    option(r, 1.0 - r, 400.0),
                    option(2.0 * r, 1.0 - 2.0 * r, 200.0),
                    option(4.0 * r, 1.0 - 4.0 * r, 100.0),
                ]
            })
            .collect()
    }

    #[test]
    fn the_router_meets_the_budget_with_a_synthetic_profile() {
        for budget in [0.9, 0.5, 0.3, 0.2, 0.15] {
            let plan = route(&heads(), budget, 50.0, 0.0);
            assert!(plan.within_budget(), "budget {budget}: {plan:?}");
            assert!(plan.fallback.iter().all(|f| !f));
            // The plan's time is what its choices add up to.
            let sum: f64 = plan.choice.iter().enumerate().map(|(h, &i)| heads()[h][i].time_us).sum::<f64>() + 50.0;
            assert!((sum - plan.planned_us).abs() < 1e-9);
        }
        // A generous budget leaves everything dense.
        assert_eq!(route(&heads(), 1.1, 50.0, 0.0).choice, vec![0; 8]);
    }

    #[test]
    fn low_risk_heads_go_sparse_first() {
        let plan = route(&heads(), 0.8, 0.0, 0.0);
        assert!(plan.within_budget());
        // Saving 20% takes the least risky heads only.
        assert!(plan.choice[0] > 0, "{plan:?}");
        assert!(plan.choice[4..].iter().all(|&c| c == 0), "{plan:?}");
    }

    #[test]
    fn heads_without_an_eligible_option_stay_dense() {
        let mut heads = heads();
        for o in &mut heads[3][1..] {
            o.lower = 0.5;
        }
        let plan = route(&heads, 0.1, 0.0, 0.9);
        assert!(plan.fallback[3] && plan.choice[3] == 0, "{plan:?}");
        // Options under τ are never taken, even when the budget is then missed.
        for (h, &c) in plan.choice.iter().enumerate() {
            assert!(heads[h][c].lower >= 0.9 || c == 0);
        }
        assert!(!plan.within_budget());
    }
}
