//! A tokenizer that is exact about what the engine saw.
//!
//! Wraps a HF `tokenizers::Tokenizer` (loaded from `tokenizer.json` bytes) with
//! the parts of `tokenizer_config.json` that chat rendering needs, and adds
//! *segment-wise* encoding: text is cut at added (control) tokens exactly as the
//! HF tokenizer cuts it before pre-tokenization, and each piece between them is
//! encoded on its own and cached. Agent traces resend their whole history on
//! every call, so almost every piece of a new prompt was seen before.
//!
//! Segment-wise encoding equals whole-text encoding only when no added token
//! strips neighbouring whitespace and the pre-tokenizer does not treat the first
//! piece differently (Metaspace `prepend_scheme: first`); `segment_safe()` says
//! whether that holds and we fall back to whole-text encoding otherwise.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use serde_json::Value as Json;

use crate::error::CoreError;
use crate::template::ChatTemplate;

/// Entries kept in the segment cache before it is cleared (bounded memory).
const CACHE_LIMIT: usize = 200_000;

/// Special-token strings and flags from `tokenizer_config.json`.
#[derive(Debug, Clone, Default)]
pub struct TokenizerConfig {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub chat_template: Option<String>,
}

fn token_string(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(m) => m.get("content").and_then(|c| c.as_str()).map(str::to_owned),
        _ => None,
    }
}

impl TokenizerConfig {
    /// Parse `tokenizer_config.json` contents. `chat_template` may be a string or
    /// a list of `{name, template}` (the one named `default` wins).
    pub fn from_json_bytes(bytes: &[u8], what: &str) -> Result<Self, CoreError> {
        let v: Json = serde_json::from_slice(bytes).map_err(|e| CoreError::TokenizerLoad {
            what: what.to_owned(),
            message: format!("invalid JSON: {e}"),
        })?;
        let chat_template = match v.get("chat_template") {
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Array(items)) => {
                let named = |n: &str| {
                    items.iter().find_map(|it| {
                        (it.get("name")?.as_str()? == n)
                            .then(|| it.get("template")?.as_str().map(str::to_owned))
                            .flatten()
                    })
                };
                named("default").or_else(|| {
                    items
                        .first()
                        .and_then(|it| it.get("template")?.as_str().map(str::to_owned))
                })
            }
            _ => None,
        };
        Ok(Self {
            bos_token: token_string(v.get("bos_token")),
            eos_token: token_string(v.get("eos_token")),
            unk_token: token_string(v.get("unk_token")),
            pad_token: token_string(v.get("pad_token")),
            add_bos_token: v.get("add_bos_token").and_then(Json::as_bool),
            add_eos_token: v.get("add_eos_token").and_then(Json::as_bool),
            chat_template,
        })
    }
}

/// Cuts text at added tokens the way `tokenizers`' AddedVocabulary does for
/// non-normalized tokens (leftmost-longest).
#[derive(Debug)]
struct Splitter {
    ac: AhoCorasick,
    ids: Vec<u32>,
    special: Vec<bool>,
}

/// One piece of text between added tokens, or an added token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece {
    Text(usize, usize),
    Added {
        id: u32,
        start: usize,
        end: usize,
        special: bool,
    },
}

/// The tokenizer: HF tokenizer + config + optional chat template + segment cache.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` without the split-out added tokens: encodes text so that it can
    /// never turn into a control token (used for protected content and, being
    /// equivalent on text without added tokens, for every segment).
    plain: tokenizers::Tokenizer,
    splitter: Option<Splitter>,
    config: TokenizerConfig,
    template: Option<ChatTemplate>,
    cache: Mutex<HashMap<String, Arc<[u32]>>>,
}

fn load_err(what: &str, e: impl std::fmt::Display) -> CoreError {
    CoreError::TokenizerLoad {
        what: what.to_owned(),
        message: e.to_string(),
    }
}

impl Tokenizer {
    /// Build from `tokenizer.json` contents, an optional config and an optional
    /// template source (a template overrides the config's).
    pub fn from_parts(
        tokenizer_json: &[u8],
        config: Option<TokenizerConfig>,
        chat_template: Option<String>,
        what: &str,
    ) -> Result<Self, CoreError> {
        let mut doc: Json = serde_json::from_slice(tokenizer_json)
            .map_err(|e| load_err(what, format!("invalid JSON: {e}")))?;
        let inner =
            tokenizers::Tokenizer::from_bytes(tokenizer_json).map_err(|e| load_err(what, e))?;
        let mut config = config.unwrap_or_default();
        if chat_template.is_some() {
            config.chat_template = chat_template;
        }

        // Added tokens that are cut out before normalization, and whether every
        // one of them behaves like a plain cut (no whitespace stripping).
        let mut cut: Vec<(String, u32, bool)> = Vec::new();
        let mut cut_is_clean = true;
        if let Some(Json::Array(added)) = doc.get("added_tokens") {
            for t in added {
                let flag = |k: &str| t.get(k).and_then(Json::as_bool).unwrap_or(false);
                if flag("normalized") {
                    continue;
                }
                let (Some(content), Some(id)) = (
                    t.get("content").and_then(Json::as_str),
                    t.get("id").and_then(Json::as_u64),
                ) else {
                    continue;
                };
                if flag("lstrip") || flag("rstrip") || flag("single_word") {
                    cut_is_clean = false;
                }
                cut.push((content.to_owned(), id as u32, flag("special")));
            }
        }
        let pre = doc
            .get("pre_tokenizer")
            .map(Json::to_string)
            .unwrap_or_default();
        let first_only = pre.contains("Metaspace") && pre.contains("\"first\"");
        let splitter = if cut_is_clean && !first_only {
            let ac = AhoCorasickBuilder::new()
                .match_kind(MatchKind::LeftmostLongest)
                .build(cut.iter().map(|c| c.0.as_str()))
                .map_err(|e| load_err(what, e))?;
            Some(Splitter {
                ac,
                ids: cut.iter().map(|c| c.1).collect(),
                special: cut.iter().map(|c| c.2).collect(),
            })
        } else {
            None
        };

        // The plain tokenizer: same model, without the cut-out added tokens.
        if let Some(Json::Array(added)) = doc.get_mut("added_tokens") {
            added.retain(|t| t.get("normalized").and_then(Json::as_bool).unwrap_or(false));
        }
        let plain_bytes = serde_json::to_vec(&doc).map_err(|e| load_err(what, e))?;
        let plain =
            tokenizers::Tokenizer::from_bytes(&plain_bytes).map_err(|e| load_err(what, e))?;

        let template = match &config.chat_template {
            Some(src) => Some(ChatTemplate::new(src)?),
            None => None,
        };
        Ok(Self {
            inner,
            plain,
            splitter,
            config,
            template,
            cache: Mutex::new(HashMap::new()),
        })
    }

    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }

    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Whether segment-wise encoding is guaranteed to equal whole-text encoding.
    pub fn segment_safe(&self) -> bool {
        self.splitter.is_some()
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is an added token marked special (a control token).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
    }

    /// Plain HF encoding (what `tokenizer(text, add_special_tokens=...)` gives).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, CoreError> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| CoreError::Tokenize(e.to_string()))
    }

    pub fn encode_batch(
        &self,
        texts: &[&str],
        add_special_tokens: bool,
    ) -> Result<Vec<Vec<u32>>, CoreError> {
        texts
            .iter()
            .map(|t| self.encode(t, add_special_tokens))
            .collect()
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, CoreError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| CoreError::Tokenize(e.to_string()))
    }

    /// Byte offsets of each token in `text` (for spans), from a whole-text encode.
    pub fn offsets(&self, text: &str) -> Result<Vec<(usize, usize)>, CoreError> {
        self.inner
            .encode(text, false)
            .map(|e| e.get_offsets().to_vec())
            .map_err(|e| CoreError::Tokenize(e.to_string()))
    }

    /// Cut `text` into text pieces and added tokens. Added-token matches that
    /// overlap a `protected` byte range are left inside the text.
    pub fn pieces(&self, text: &str, protected: &[(usize, usize)]) -> Vec<Piece> {
        let mut out = Vec::new();
        let mut at = 0;
        if let Some(sp) = &self.splitter {
            for m in sp.ac.find_iter(text) {
                let (s, e) = (m.start(), m.end());
                if protected.iter().any(|&(a, b)| s < b && a < e) {
                    continue;
                }
                if at < s {
                    out.push(Piece::Text(at, s));
                }
                let k = m.pattern().as_usize();
                out.push(Piece::Added {
                    id: sp.ids[k],
                    start: s,
                    end: e,
                    special: sp.special[k],
                });
                at = e;
            }
        }
        if at < text.len() {
            out.push(Piece::Text(at, text.len()));
        }
        out
    }

    /// Encode one piece of text that contains no added token to split out.
    fn encode_segment(&self, seg: &str, use_cache: bool) -> Result<Arc<[u32]>, CoreError> {
        if use_cache {
            if let Ok(cache) = self.cache.lock() {
                if let Some(ids) = cache.get(seg) {
                    return Ok(ids.clone());
                }
            }
        }
        let ids: Arc<[u32]> = self
            .plain
            .encode_fast(seg, false)
            .map_err(|e| CoreError::Tokenize(e.to_string()))?
            .get_ids()
            .into();
        if use_cache {
            if let Ok(mut cache) = self.cache.lock() {
                if cache.len() >= CACHE_LIMIT {
                    cache.clear();
                }
                cache.insert(seg.to_owned(), ids.clone());
            }
        }
        Ok(ids)
    }

    /// Encode without added special tokens (BOS/EOS from the post-processor),
    /// as `apply_chat_template(tokenize=True)` does: segment-wise and cached when
    /// that is exact for this tokenizer. Added-token text inside a `protected`
    /// range stays text (it cannot become a control token). Falls back to the
    /// whole-text encoder when segments are not exact (then `protected` is
    /// ignored; see `segment_safe`).
    pub fn encode_segments(
        &self,
        text: &str,
        protected: &[(usize, usize)],
        use_cache: bool,
    ) -> Result<Vec<u32>, CoreError> {
        if self.splitter.is_none() {
            return self.encode(text, false);
        }
        let mut out = Vec::with_capacity(text.len() / 3);
        for p in self.pieces(text, protected) {
            match p {
                Piece::Added { id, .. } => out.push(id),
                Piece::Text(a, b) => {
                    out.extend_from_slice(&self.encode_segment(&text[a..b], use_cache)?)
                }
            }
        }
        Ok(out)
    }

    /// Forget cached segments.
    pub fn clear_cache(&self) {
        if let Ok(mut c) = self.cache.lock() {
            c.clear();
        }
    }

    /// How many added special tokens appear in `text` (would be injected as
    /// control tokens if `text` were message content encoded in parity mode).
    pub fn count_control_tokens(&self, text: &str) -> usize {
        self.pieces(text, &[])
            .iter()
            .filter(|p| matches!(p, Piece::Added { special: true, .. }))
            .count()
    }
}
