//! Choosing the next token from logits, in llama.cpp's default order:
//! repetition penalty → top-k → top-p → min-p → temperature → draw.
//! Temperature 0 is greedy (ties go to the lowest id).

use std::collections::VecDeque;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

#[derive(Debug, Clone, serde::Serialize)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 keeps every token.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, repeat_penalty: 1.0, repeat_last_n: 64, seed: 0 }
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    recent: VecDeque<u32>,
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Self { params, rng, recent: VecDeque::new(), candidates: Vec::new() }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a token (prompt or generated) for the repetition penalty.
    pub fn accept(&mut self, token: u32) {
        if self.params.repeat_last_n == 0 {
            return;
        }
        if self.recent.len() == self.params.repeat_last_n {
            self.recent.pop_front();
        }
        self.recent.push_back(token);
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        self.candidates.clear();
        self.candidates.extend(logits.iter().enumerate().map(|(id, &l)| (id as u32, l)));
        if p.repeat_penalty != 1.0 {
            let mut seen: Vec<u32> = self.recent.iter().copied().collect();
            seen.sort_unstable();
            seen.dedup();
            for id in seen {
                if let Some(c) = self.candidates.get_mut(id as usize) {
                    c.1 = if c.1 <= 0.0 { c.1 * p.repeat_penalty } else { c.1 / p.repeat_penalty };
                }
            }
        }
        if p.temperature <= 0.0 {
            // Candidates are still in id order, so the first maximum has the lowest id.
            let best = self.candidates.iter().fold(self.candidates[0], |best, &c| if c.1 > best.1 { c } else { best });
            return best.0;
        }

        // Highest first; ties by id so that a seed reproduces a run exactly.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < self.candidates.len() {
            self.candidates.select_nth_unstable_by(p.top_k - 1, by_logit);
            self.candidates.truncate(p.top_k);
        }
        self.candidates.sort_unstable_by(by_logit);
        let probs = softmax(self.candidates.iter().map(|c| c.1));
        if p.top_p < 1.0 {
            let mut cumulative = 0.0;
            let keep = probs.iter().position(|&q| {
                cumulative += q;
                cumulative >= p.top_p
            });
            self.candidates.truncate(keep.map_or(self.candidates.len(), |i| i + 1));
        }
        if p.min_p > 0.0 {
            let floor = self.candidates[0].1 + p.min_p.ln();
            let keep = self.candidates.iter().take_while(|c| c.1 >= floor).count().max(1);
            self.candidates.truncate(keep);
        }
        let probs = softmax(self.candidates.iter().map(|c| c.1 / p.temperature));
        let mut draw: f32 = self.rng.random();
        for (c, q) in self.candidates.iter().zip(&probs) {
            if draw < *q {
                return c.0;
            }
            draw -= q;
        }
        self.candidates.last().map_or(0, |c| c.0)
    }
}

fn softmax(logits: impl Iterator<Item = f32> + Clone) -> Vec<f32> {
    let max = logits.clone().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.map(|l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

/// Index of the largest value, lowest index on ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}
