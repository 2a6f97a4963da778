//! Prompt and sampling flags shared by the commands that generate: how a request's input is given
//! (`--prompt`, `--chat`, `--messages`, `--token-ids`) and how tokens are picked.

use anyhow::{bail, Context, Result};
use clap::Args;
use layerstream_model::{Message, Tokenizer};
use layerstream_serving::{GenerateParams, SamplingParams};
use std::path::PathBuf;

/// Exactly one way of giving the input.
#[derive(Args, Debug, Clone)]
#[group(required = false, multiple = false)]
pub struct PromptArgs {
    /// Raw text, tokenized as HF does (special tokens as the tokenizer configures).
    #[arg(long, env = "LAYERSTREAM_PROMPT")]
    pub prompt: Option<String>,
    /// One user turn rendered through the model's chat template, with the generation prompt.
    #[arg(long, env = "LAYERSTREAM_CHAT")]
    pub chat: Option<String>,
    /// A JSON file holding a list of {"role", "content"} messages, rendered through the template.
    #[arg(long, env = "LAYERSTREAM_MESSAGES")]
    pub messages: Option<PathBuf>,
    /// Comma-separated token ids, fed as they are.
    #[arg(long, env = "LAYERSTREAM_TOKEN_IDS", value_delimiter = ',')]
    pub token_ids: Option<Vec<u32>>,
}

impl PromptArgs {
    /// Whether any input was given.
    pub fn is_given(&self) -> bool {
        self.prompt.is_some()
            || self.chat.is_some()
            || self.messages.is_some()
            || self.token_ids.is_some()
    }
}

/// Sampling and stopping.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Maximum tokens to generate.
    #[arg(long, env = "LAYERSTREAM_MAX_NEW_TOKENS", default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, env = "LAYERSTREAM_TEMPERATURE", default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, env = "LAYERSTREAM_TOP_K", default_value_t = 0)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = off).
    #[arg(long, env = "LAYERSTREAM_TOP_P", default_value_t = 1.0)]
    pub top_p: f32,
    /// Penalise tokens already seen (1 = off; HF semantics).
    #[arg(long, env = "LAYERSTREAM_REPETITION_PENALTY", default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Random seed: the same seed gives the same tokens.
    #[arg(long, env = "LAYERSTREAM_SEED", default_value_t = 0)]
    pub seed: u64,
    /// Stop when the output contains this string (repeatable); the string is not returned.
    #[arg(long, env = "LAYERSTREAM_STOP")]
    pub stop: Vec<String>,
    /// Keep generating past the end-of-sequence token.
    #[arg(long, env = "LAYERSTREAM_IGNORE_EOS")]
    pub ignore_eos: bool,
    /// This request's most drafted tokens per weight pass (speculative decoding; 0 = none for it;
    /// default: the server's `--spec-max`).
    #[arg(long, env = "LAYERSTREAM_DRAFT_MAX")]
    pub draft_max: Option<u32>,
    /// This request's shortest draft worth verifying (shorter proposals are dropped).
    #[arg(long, env = "LAYERSTREAM_DRAFT_MIN", default_value_t = 0)]
    pub draft_min: u32,
}

impl SamplingArgs {
    /// The generation parameters these flags describe.
    pub fn params(&self) -> GenerateParams {
        GenerateParams {
            max_new_tokens: self.max_new_tokens,
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
            sampling: SamplingParams {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                repetition_penalty: self.repetition_penalty,
                seed: self.seed,
                ..Default::default()
            },
            speculative: layerstream_serving::spec::SpecLimits {
                n_max: self.draft_max.map(|n| n as usize),
                n_min: self.draft_min as usize,
            },
            prompt_logprobs: None,
        }
    }
}

impl PromptArgs {
    /// Turns the chosen input into token ids.
    pub fn input_ids(&self, tok: &Tokenizer) -> Result<Vec<u32>> {
        if let Some(ids) = &self.token_ids {
            return Ok(ids.clone());
        }
        if let Some(p) = &self.prompt {
            return Ok(tok.encode(p)?);
        }
        let messages: Vec<Message> = match (&self.chat, &self.messages) {
            (Some(c), _) => vec![Message::new("user", c)],
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                serde_json::from_str(&text).with_context(|| {
                    format!("{}: expected a JSON list of {{\"role\", \"content\"}}", path.display())
                })?
            }
            (None, None) => bail!("give one of --prompt, --chat, --messages, --token-ids"),
        };
        Ok(tok.encode_chat(&tok.apply_chat_template(&messages)?)?)
    }
}
