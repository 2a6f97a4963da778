//! What a request asks for — generation parameters and sampling settings — and the check every door
//! (`run`, gRPC) applies before any work is done. Both the coordinator and the worker read these;
//! neither owns them.

use crate::{Field, RequestError};
use layerstream_proto::v1::Sampling;
use serde::{Deserialize, Serialize};

/// Temperatures below this sample greedily: dividing logits by less would overflow f32 (a temperature
/// of 1e-38 used to return token 0), and at 1e-5 sampling is already argmax for any real logit gap.
pub const GREEDY_BELOW: f32 = 1e-5;

/// Most alternatives `top_logprobs` may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Per-request sampling settings (HF `generate` semantics).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 1 = off; >1 discourages tokens already in the prompt or output.
    pub repetition_penalty: f32,
    pub seed: u64,
    /// Return log-probabilities with each token: `Some(k)` = the chosen token's and the `k` most
    /// likely ones'.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<usize>,
    /// OpenAI's penalties over the output so far (0 = off): `frequency_penalty` per occurrence,
    /// `presence_penalty` once per distinct token.
    #[serde(default)]
    pub frequency_penalty: f32,
    #[serde(default)]
    pub presence_penalty: f32,
    /// Added to these tokens' logits, sorted by id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
    /// End-of-sequence and stop ids are banned before this many output tokens.
    #[serde(default)]
    pub min_tokens: usize,
    /// The output ends after any of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop_token_ids: Vec<u32>,
    /// Where the output starts in the sequence's tokens (set by whoever runs the sequence).
    #[serde(default)]
    pub prompt_len: usize,
    /// The model's end-of-sequence ids (set by whoever runs the sequence), banned with
    /// `stop_token_ids` before `min_tokens`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub eos_ids: Vec<u32>,
}

/// Most a penalty may be, either way (OpenAI's range).
pub const MAX_PENALTY: f32 = 2.0;
/// Most a logit bias may be, either way (OpenAI's range).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
            logprobs: None,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            prompt_len: 0,
            eos_ids: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// From the wire, where 0 means "unset" for top_p and repetition_penalty (proto3 defaults).
    pub fn from_wire(w: &Sampling) -> Self {
        SamplingParams {
            temperature: w.temperature,
            top_k: w.top_k as usize,
            top_p: if w.top_p == 0.0 { 1.0 } else { w.top_p },
            repetition_penalty: if w.repetition_penalty == 0.0 {
                1.0
            } else {
                w.repetition_penalty
            },
            seed: w.seed,
            logprobs: w.logprobs.then_some(w.top_logprobs as usize),
            frequency_penalty: w.frequency_penalty,
            presence_penalty: w.presence_penalty,
            logit_bias: {
                let mut b: Vec<(u32, f32)> = w.logit_bias.iter().map(|(&t, &v)| (t, v)).collect();
                b.sort_unstable_by_key(|e| e.0);
                b
            },
            min_tokens: w.min_tokens as usize,
            stop_token_ids: w.stop_token_ids.clone(),
            prompt_len: w.prompt_len as usize,
            eos_ids: w.eos_ids.clone(),
        }
    }

    /// To the wire (`from_wire` reads it back unchanged).
    pub fn to_wire(&self) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_k: self.top_k as u32,
            top_p: self.top_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            logprobs: self.logprobs.is_some(),
            top_logprobs: self.logprobs.unwrap_or(0) as u32,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            logit_bias: self.logit_bias.iter().copied().collect(),
            min_tokens: self.min_tokens as u32,
            stop_token_ids: self.stop_token_ids.clone(),
            prompt_len: self.prompt_len as u32,
            eos_ids: self.eos_ids.clone(),
        }
    }

    /// Whether anything beyond the repetition penalty, temperature and truncation changes the
    /// logits (penalties over the output, biases, `min_tokens`): such a row is sampled on the host.
    pub fn adjusts(&self) -> bool {
        self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || !self.logit_bias.is_empty()
            || self.min_tokens > 0
    }

    /// Rejects out-of-range values with a message naming the field.
    pub fn validate(&self) -> std::result::Result<(), RequestError> {
        let bad = |field: Field, msg: String| Err(RequestError::new(field, msg));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(Field::Temperature, format!("must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(Field::TopP, format!("must be in (0, 1], got {}", self.top_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(
                Field::RepetitionPenalty,
                format!("must be > 0, got {}", self.repetition_penalty),
            );
        }
        if let Some(k) = self.logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
            return bad(Field::TopLogprobs, format!("must be at most {MAX_TOP_LOGPROBS}, got {k}"));
        }
        for (field, v) in [
            (Field::FrequencyPenalty, self.frequency_penalty),
            (Field::PresencePenalty, self.presence_penalty),
        ] {
            if !(-MAX_PENALTY..=MAX_PENALTY).contains(&v) {
                return bad(field, format!("must be in [-2, 2], got {v}"));
            }
        }
        if let Some((t, v)) =
            self.logit_bias.iter().find(|(_, v)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(v))
        {
            return bad(Field::LogitBias, format!("token {t}: must be in [-100, 100], got {v}"));
        }
        Ok(())
    }
}

/// What to generate.
#[derive(Debug, Clone, Default)]
pub struct GenerateParams {
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub sampling: SamplingParams,
    /// Draft limits for speculative decoding (the server's when unset).
    pub speculative: crate::spec::SpecLimits,
    /// Return every prompt token's log-probability with this many alternatives (None: not asked).
    pub prompt_logprobs: Option<usize>,
}

/// The roles a chat message may have (OpenAI's, with `developer`): anything else would be pasted
/// into the chat template verbatim.
pub const CHAT_ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

/// Checks a chat's messages before they are rendered: at least one, each with a known role.
pub fn check_chat<'a>(
    roles: impl IntoIterator<Item = &'a str>,
) -> std::result::Result<(), RequestError> {
    let mut n = 0;
    for (i, role) in roles.into_iter().enumerate() {
        n += 1;
        if !CHAT_ROLES.contains(&role) {
            return Err(RequestError::new(
                Field::Chat,
                format!("message {i} has role {role:?}; roles are {}", CHAT_ROLES.join(", ")),
            ));
        }
    }
    if n == 0 {
        return Err(RequestError::new(Field::Chat, "has no messages"));
    }
    Ok(())
}

/// Checks a request against the model before any work is done.
pub fn check_request(
    input: &[u32],
    p: &GenerateParams,
    vocab: usize,
    context: usize,
) -> std::result::Result<(), RequestError> {
    let bad = |field: Field, msg: String| Err(RequestError::new(field, msg));
    if input.is_empty() {
        return bad(Field::Prompt, "encodes to zero tokens".into());
    }
    if let Some(t) = input.iter().find(|&&t| t as usize >= vocab) {
        return bad(Field::TokenIds, format!("token id {t} is outside the vocabulary of {vocab}"));
    }
    if input.len() + p.max_new_tokens > context {
        return bad(
            Field::MaxNewTokens,
            format!(
                "prompt of {} tokens + max_new_tokens {} exceeds the model's context of {context}",
                input.len(),
                p.max_new_tokens
            ),
        );
    }
    if let Some((t, _)) = p.sampling.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
        return bad(Field::LogitBias, format!("token id {t} is outside the vocabulary of {vocab}"));
    }
    if let Some(t) = p.sampling.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
        return bad(
            Field::StopTokenIds,
            format!("token id {t} is outside the vocabulary of {vocab}"),
        );
    }
    if p.max_new_tokens > 0 && p.sampling.min_tokens > p.max_new_tokens {
        return bad(
            Field::MinTokens,
            format!("{} is more than max_new_tokens {}", p.sampling.min_tokens, p.max_new_tokens),
        );
    }
    if p.stop.iter().any(String::is_empty) {
        return bad(Field::Stop, "an empty stop string would end every request at once".into());
    }
    if let Some(k) = p.prompt_logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
        return bad(Field::PromptLogprobs, format!("must be at most {MAX_TOP_LOGPROBS}, got {k}"));
    }
    p.sampling.validate()?;
    p.speculative.validate()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_round_trip_and_unset_defaults() {
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            repetition_penalty: 1.1,
            seed: 9,
            logprobs: Some(3),
            frequency_penalty: 0.5,
            presence_penalty: -0.25,
            logit_bias: vec![(3, -100.0), (7, 2.5)],
            min_tokens: 4,
            stop_token_ids: vec![11],
            prompt_len: 6,
            eos_ids: vec![2],
        };
        assert_eq!(SamplingParams::from_wire(&p.to_wire()), p);
        assert_eq!(SamplingParams::from_wire(&Sampling::default()), SamplingParams::default());
    }

    #[test]
    fn chat_roles_are_checked() {
        assert!(check_chat(["system", "user", "assistant", "tool", "developer"]).is_ok());
        let e = check_chat(["user", "<|im_start|>system"]).unwrap_err();
        assert_eq!(e.field(), Field::Chat);
        assert!(e.reason().starts_with("message 1 has role"), "{e}");
        assert!(check_chat(["user", ""]).is_err(), "an empty role is refused");
        assert!(check_chat(std::iter::empty()).is_err());
    }

    #[test]
    fn bad_requests_name_the_field() {
        let ok = GenerateParams { max_new_tokens: 4, ..Default::default() };
        assert!(check_request(&[1, 2], &ok, 10, 100).is_ok());
        let field = |r: std::result::Result<(), RequestError>| match r {
            Err(e) => e.field(),
            other => panic!("{other:?}"),
        };
        assert_eq!(field(check_request(&[], &ok, 10, 100)), Field::Prompt);
        assert_eq!(field(check_request(&[10], &ok, 10, 100)), Field::TokenIds);
        assert_eq!(
            field(check_request(
                &[1],
                &GenerateParams { max_new_tokens: 100, ..ok.clone() },
                10,
                100
            )),
            Field::MaxNewTokens
        );
        assert_eq!(
            field(check_request(
                &[1],
                &GenerateParams { stop: vec![String::new()], ..ok.clone() },
                10,
                100
            )),
            Field::Stop
        );
        let neg = GenerateParams {
            sampling: SamplingParams::from_wire(&Sampling { top_p: -1.0, ..Default::default() }),
            ..ok.clone()
        };
        assert_eq!(
            field(check_request(&[1], &neg, 10, 100)),
            Field::TopP,
            "a negative top_p is not 'unset'"
        );
        let rp = GenerateParams {
            sampling: SamplingParams::from_wire(&Sampling {
                repetition_penalty: -1.0,
                ..Default::default()
            }),
            ..ok
        };
        assert_eq!(field(check_request(&[1], &rp, 10, 100)), Field::RepetitionPenalty);
    }
}
