//! Choosing the next token from logits, in llama.cpp's default order:
//! logit bias → penalties (repetition, presence, frequency) → top-k → top-p → min-p →
//! temperature → draw. Temperature 0 is greedy (ties go to the lowest id), after the bias and
//! the penalties.

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
    /// Divides a positive logit (multiplies a negative one) of every token seen recently.
    pub repeat_penalty: f32,
    /// Subtracted from the logit of every token seen recently, once.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once for each time it was seen recently.
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at.
    pub repeat_last_n: usize,
    /// Added to the logits of the tokens named, before anything else.
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repeat_last_n: 64,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Whether every setting is in its range, and every biased token in a vocabulary of
    /// `n_vocab`; the message names the setting by its OpenAI field.
    pub fn check(&self, n_vocab: usize) -> Result<(), String> {
        let rule = |ok: bool, rule: &str| if ok { Ok(()) } else { Err(rule.to_string()) };
        rule(self.temperature.is_finite() && self.temperature >= 0.0, "temperature must be at least 0")?;
        rule(self.top_p > 0.0 && self.top_p <= 1.0, "top_p must be in (0, 1]")?;
        rule((0.0..=1.0).contains(&self.min_p), "min_p must be between 0 and 1")?;
        rule(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0, "repeat_penalty must be above 0")?;
        rule((-2.0..=2.0).contains(&self.presence_penalty), "presence_penalty must be between -2 and 2")?;
        rule((-2.0..=2.0).contains(&self.frequency_penalty), "frequency_penalty must be between -2 and 2")?;
        for &(id, bias) in &self.logit_bias {
            rule((id as usize) < n_vocab, &format!("logit_bias: token {id} is not in the vocabulary of {n_vocab}"))?;
            rule(
                bias == f32::NEG_INFINITY || (-100.0..=100.0).contains(&bias),
                "logit_bias must be between -100 and 100",
            )?;
        }
        Ok(())
    }

    fn penalizes(&self) -> bool {
        self.repeat_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// A seed from the clock, for runs and requests that give none.
pub fn clock_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
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

    /// The candidates: every token with its logit, biased and penalised.
    fn adjust(&mut self, logits: &[f32]) {
        let p = &self.params;
        self.candidates.clear();
        self.candidates.extend(logits.iter().enumerate().map(|(id, &l)| (id as u32, l)));
        for &(id, bias) in &p.logit_bias {
            if let Some(c) = self.candidates.get_mut(id as usize) {
                c.1 += bias;
            }
        }
        if p.penalizes() {
            let mut seen: Vec<u32> = self.recent.iter().copied().collect();
            seen.sort_unstable();
            for run in seen.chunk_by(|a, b| a == b) {
                if let Some(c) = self.candidates.get_mut(run[0] as usize) {
                    c.1 = if c.1 <= 0.0 { c.1 * p.repeat_penalty } else { c.1 / p.repeat_penalty };
                    c.1 -= run.len() as f32 * p.frequency_penalty + p.presence_penalty;
                }
            }
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        self.adjust(logits);
        let p = &self.params;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_and_penalties_follow_llama_cpp() {
        let params = SamplingParams {
            temperature: 0.0,
            repeat_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            repeat_last_n: 3,
            logit_bias: vec![(2, 1.5), (3, -100.0)],
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(params);
        // Token 4 leaves the window of 3; token 0 is in it twice, token 1 once.
        for id in [4, 0, 0, 1] {
            sampler.accept(id);
        }
        let logits = [2.0, -1.0, 0.5, 3.0, 1.0];
        sampler.adjust(&logits);
        let adjusted: Vec<f32> = sampler.candidates.iter().map(|c| c.1).collect();
        // 2 / 2 - (2 * 0.25 + 0.5); -1 * 2 - (0.25 + 0.5); 0.5 + 1.5; 3 - 100; 1 untouched.
        assert_eq!(adjusted, [0.0, -2.75, 2.0, -97.0, 1.0]);
        assert_eq!(sampler.sample(&logits), 2);
    }

    #[test]
    fn a_banned_token_is_never_drawn() {
        let params = SamplingParams { logit_bias: vec![(0, f32::NEG_INFINITY)], ..SamplingParams::default() };
        let mut sampler = Sampler::new(params);
        for _ in 0..200 {
            assert_ne!(sampler.sample(&[5.0, 0.0, 0.1]), 0);
        }
    }

    #[test]
    fn settings_out_of_range_are_named() {
        let ok = SamplingParams::default();
        assert_eq!(ok.check(10), Ok(()));
        let cases = [
            (SamplingParams { top_p: 0.0, ..ok.clone() }, "top_p"),
            (SamplingParams { min_p: f32::NAN, ..ok.clone() }, "min_p"),
            (SamplingParams { temperature: -1.0, ..ok.clone() }, "temperature"),
            (SamplingParams { repeat_penalty: 0.0, ..ok.clone() }, "repeat_penalty"),
            (SamplingParams { presence_penalty: 2.5, ..ok.clone() }, "presence_penalty"),
            (SamplingParams { frequency_penalty: -3.0, ..ok.clone() }, "frequency_penalty"),
            (SamplingParams { logit_bias: vec![(10, 1.0)], ..ok.clone() }, "token 10"),
            (SamplingParams { logit_bias: vec![(1, 101.0)], ..ok.clone() }, "logit_bias"),
        ];
        for (params, named) in cases {
            let message = params.check(10).unwrap_err();
            assert!(message.contains(named), "{message}");
        }
    }
}
