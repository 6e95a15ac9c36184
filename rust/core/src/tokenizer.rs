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

use ahash::AHashMap as HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use serde_json::Value as Json;

use crate::error::CoreError;
use crate::template::ChatTemplate;

/// Entries kept in the segment cache before it is cleared (bounded memory).
const CACHE_LIMIT: usize = 200_000;
/// Entries kept in the word cache before it is cleared (bounded memory).
const WORD_CACHE_LIMIT: usize = 200_000;

/// GPT-2's pre-tokenizer pattern, which `ByteLevel { use_regex: true }` applies.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Text the word path must encode exactly as the full pipeline before it is
/// trusted (checked once per tokenizer at load): contractions, digits, code,
/// whitespace runs and line ends, punctuation runs, accents, CJK, emoji.
const WORD_PATH_PROBES: [&str; 2] = [
    "Hello world! It's 2024: don't we'll I'd they've 3.14159 x=42;\n\
     \tdef f(a, b):\n        return a+b  # sum\n\n\n  \r\n end.   \n {\"k\": [1, 2]} <tag/> ...!?  ",
    "\u{a0}caf\u{e9} na\u{ef}ve \u{65e5}\u{672c}\u{8a9e}\u{3067}\u{3059} \u{1f600}\u{1f44d}\u{1f3fd} \
     J'ai \u{0434}\u{043e}\u{043c}  \u{0627}\u{0644}\u{0639}\u{0631}\u{0628}\u{064a}\u{0629}   \u{2003}x",
];

/// Special-token strings and flags from `tokenizer_config.json`.
#[derive(Debug, Clone, Default)]
pub struct TokenizerConfig {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
    /// Read, and deliberately not applied: transformers 5 (`TokenizersBackend`)
    /// adds BOS/EOS as `tokenizer.json`'s post-processor says, whatever these
    /// flags are (4.x's `LlamaTokenizerFast` rebuilt it from them).
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub chat_template: Option<String>,
    /// Added tokens a chat template writes that must never come from user
    /// text (transformers' `chat_control_tokens`); special tokens always are.
    pub chat_control_tokens: Option<Vec<String>>,
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
            chat_control_tokens: v
                .get("chat_control_tokens")
                .and_then(Json::as_array)
                .map(|a| a.iter().filter_map(|t| token_string(Some(t))).collect()),
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

/// What `protect_content` needs, computed once per tokenizer.
#[derive(Debug)]
struct Controls {
    /// None when there is no control token; an error (kept to be reported on
    /// every protected encode, never to protect nothing) if it cannot be built.
    matcher: Result<Option<AhoCorasick>, String>,
    added: Vec<String>,
}

/// The tokenizer: HF tokenizer + config + optional chat template + segment cache.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` without the split-out added tokens: encodes the text between
    /// them (being equivalent there, for every segment).
    plain: tokenizers::Tokenizer,
    /// `inner` without any added token, for text that must stay text
    /// (transformers' `_encode_without_added_tokens`); `None` when `plain`
    /// already has none left (no added token is `normalized`).
    bare: Option<tokenizers::Tokenizer>,
    /// The control tokens of `protect_content` and a matcher for them, built
    /// on first use.
    controls: OnceLock<Controls>,
    splitter: Option<Splitter>,
    config: TokenizerConfig,
    template: Option<ChatTemplate>,
    cache: Mutex<HashMap<String, Arc<[u32]>>>,
    words: Option<WordPath>,
}

/// A faster exact path for byte-level BPE tokenizers. The `tokenizers`
/// pipeline pays per call for alignment tracking and per-token strings that
/// ids-only encoding never reads; its BPE cache saves only the merges. Here a
/// segment is cut with the tokenizer's own pre-tokenizer regex, and each word's
/// ids are looked up in a cache; a miss encodes the word alone through the full
/// pipeline. That is exact because the pre-tokenizer splits a word it produced
/// back into itself (no look-behind; the pattern's look-ahead only inspects
/// whitespace the word ends with), which `Tokenizer::from_parts` also checks on
/// a probe text before enabling it.
#[derive(Debug)]
struct WordPath {
    re: tokenizers::utils::SysRegex,
    /// The normalizer is NFC: only ASCII segments (where NFC is the identity)
    /// may take this path.
    ascii_only: bool,
    cache: Mutex<HashMap<String, Box<[u32]>>>,
}

impl WordPath {
    /// Recognize the pre-tokenizers this path reproduces: `ByteLevel` with the
    /// GPT-2 regex, or `Split(regex, Isolated)` then `ByteLevel` without one
    /// (Llama 3, Qwen2). No normalizer, or NFC. Anything else: `None`.
    fn detect(doc: &Json) -> Option<Self> {
        let ascii_only = match doc.get("normalizer") {
            None | Some(Json::Null) => false,
            Some(n) if n.get("type").and_then(Json::as_str) == Some("NFC") => true,
            Some(_) => return None,
        };
        let model = doc.get("model")?;
        if model.get("type")?.as_str()? != "BPE" || !model.get("dropout").is_none_or(Json::is_null)
        {
            return None;
        }
        let byte_level = |p: &Json, regex: bool| {
            p.get("type").and_then(Json::as_str) == Some("ByteLevel")
                && p.get("add_prefix_space").and_then(Json::as_bool) == Some(false)
                && p.get("use_regex").and_then(Json::as_bool).unwrap_or(true) == regex
        };
        let pre = doc.get("pre_tokenizer")?;
        let pattern = if byte_level(pre, true) {
            GPT2_PATTERN.to_owned()
        } else if pre.get("type").and_then(Json::as_str) == Some("Sequence") {
            let steps = pre.get("pretokenizers")?.as_array()?;
            let [split, bl] = steps.as_slice() else {
                return None;
            };
            let ok = split.get("type").and_then(Json::as_str) == Some("Split")
                && split.get("behavior").and_then(Json::as_str) == Some("Isolated")
                && split.get("invert").and_then(Json::as_bool) == Some(false)
                && byte_level(bl, false);
            if !ok {
                return None;
            }
            split.get("pattern")?.get("Regex")?.as_str()?.to_owned()
        } else {
            return None;
        };
        Some(Self {
            re: tokenizers::utils::SysRegex::new(&pattern).ok()?,
            ascii_only,
            cache: Mutex::new(HashMap::new()),
        })
    }

    fn clear(&self) {
        if let Ok(mut c) = self.cache.lock() {
            c.clear();
        }
    }

    /// Append the ids of `seg` (text without added tokens) to `out`, or return
    /// false when this segment must take the full pipeline.
    fn encode(
        &self,
        plain: &tokenizers::Tokenizer,
        seg: &str,
        out: &mut Vec<u32>,
    ) -> Result<bool, CoreError> {
        if self.ascii_only && !seg.is_ascii() {
            return Ok(false);
        }
        let Ok(mut cache) = self.cache.lock() else {
            return Ok(false);
        };
        let mut word = |w: &str, out: &mut Vec<u32>| -> Result<(), CoreError> {
            if let Some(ids) = cache.get(w) {
                out.extend_from_slice(ids);
                return Ok(());
            }
            let ids: Box<[u32]> = plain
                .encode_fast(w, false)
                .map_err(|e| CoreError::Tokenize(e.to_string()))?
                .get_ids()
                .into();
            out.extend_from_slice(&ids);
            if cache.len() >= WORD_CACHE_LIMIT {
                cache.clear();
            }
            cache.insert(w.to_owned(), ids);
            Ok(())
        };
        // Isolated split: the matches and the gaps between them are all words.
        let mut prev = 0;
        for (a, b) in self.re.find_iter(seg) {
            if prev < a {
                word(&seg[prev..a], out)?;
            }
            if a < b {
                word(&seg[a..b], out)?;
            }
            prev = b;
        }
        if prev < seg.len() {
            word(&seg[prev..], out)?;
        }
        Ok(true)
    }
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
        let bare = match doc.get_mut("added_tokens") {
            Some(Json::Array(added)) if !added.is_empty() => {
                added.clear();
                let bytes = serde_json::to_vec(&doc).map_err(|e| load_err(what, e))?;
                Some(tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| load_err(what, e))?)
            }
            _ => None,
        };

        let template = match &config.chat_template {
            Some(src) => Some(ChatTemplate::new(src)?),
            None => None,
        };
        // Trust the word path only where it reproduces the pipeline on the probes
        // it accepts (and it must accept the ASCII one), and never beside
        // `normalized` added tokens (`bare` exists exactly then): those are
        // matched after normalization, across the words the regex would cut.
        let words = WordPath::detect(&doc).filter(|w| {
            bare.is_none()
                && WORD_PATH_PROBES.iter().enumerate().all(|(k, probe)| {
                    let mut ids = Vec::new();
                    match w.encode(&plain, probe, &mut ids) {
                        Ok(true) => plain
                            .encode_fast(*probe, false)
                            .is_ok_and(|e| e.get_ids() == ids.as_slice()),
                        Ok(false) => k > 0,
                        Err(_) => false,
                    }
                })
        });
        if let Some(w) = &words {
            w.clear();
        }
        Ok(Self {
            inner,
            plain,
            bare,
            controls: OnceLock::new(),
            splitter,
            config,
            template,
            cache: Mutex::new(HashMap::new()),
            words,
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

    /// Cut `text` into text pieces and added tokens.
    pub fn pieces(&self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        let mut at = 0;
        if let Some(sp) = &self.splitter {
            for m in sp.ac.find_iter(text) {
                let (s, e) = (m.start(), m.end());
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
        let mut fast = Vec::new();
        let ids: Arc<[u32]> = match &self.words {
            Some(w) if w.encode(&self.plain, seg, &mut fast)? => fast.into(),
            _ => self
                .plain
                .encode_fast(seg, false)
                .map_err(|e| CoreError::Tokenize(e.to_string()))?
                .get_ids()
                .into(),
        };
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
    /// that is exact for this tokenizer. Falls back to the whole-text encoder
    /// when segments are not exact (see `segment_safe`).
    pub fn encode_segments(&self, text: &str, use_cache: bool) -> Result<Vec<u32>, CoreError> {
        if self.splitter.is_none() {
            return self.encode(text, false);
        }
        let mut out = Vec::with_capacity(text.len() / 3);
        for p in self.pieces(text) {
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
        if let Some(w) = &self.words {
            w.clear();
        }
    }

    /// Whether segments take the cached word path (byte-level BPE tokenizers
    /// whose pre-tokenizer it reproduces, checked at load).
    pub fn word_path(&self) -> bool {
        self.words.is_some()
    }

    /// A leftmost-longest matcher for the tokens user text must not produce
    /// under `protect_content` (None when there are none), picked as
    /// transformers' `sanitize_control_tokens` picks them: every special added
    /// token, plus the added tokens listed in `chat_control_tokens` or, without
    /// that list, those the chat template writes in its own text (whitespace
    /// tokens excepted: templates write those as ordinary text).
    pub fn control_matcher(&self) -> Result<Option<&AhoCorasick>, CoreError> {
        match &self.controls().matcher {
            Ok(m) => Ok(m.as_ref()),
            Err(e) => Err(CoreError::Tokenize(format!(
                "cannot match this tokenizer's control tokens: {e}"
            ))),
        }
    }

    /// Every added token's text, longest first (what a protected render's
    /// markers may wrap).
    pub fn added_token_texts(&self) -> &[String] {
        &self.controls().added
    }

    fn controls(&self) -> &Controls {
        self.controls.get_or_init(|| {
            let listed = self.config.chat_control_tokens.as_ref();
            let mut added: Vec<_> = self.inner.get_added_tokens_decoder().into_iter().collect();
            added.sort_by_key(|(id, _)| *id);
            let tokens: Vec<String> = added
                .iter()
                .map(|(_, t)| t)
                .filter(|t| {
                    t.special
                        || match listed {
                            Some(list) => list.contains(&t.content),
                            None => {
                                !t.content.chars().all(crate::template::py_space)
                                    && self
                                        .template
                                        .as_ref()
                                        .is_some_and(|tpl| tpl.writes_literally(&t.content))
                            }
                        }
                })
                .map(|t| t.content.clone())
                .collect();
            let matcher = if tokens.is_empty() {
                Ok(None)
            } else {
                AhoCorasickBuilder::new()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&tokens)
                    .map(Some)
                    .map_err(|e| e.to_string())
            };
            let mut texts: Vec<String> = added.into_iter().map(|(_, t)| t.content).collect();
            texts.sort_by_key(|t| std::cmp::Reverse(t.len()));
            Controls {
                matcher,
                added: texts,
            }
        })
    }

    /// Encode `text` through normalizer, pre-tokenizer and model only: added
    /// tokens are not split out, so it never yields a control token from them.
    pub fn encode_text_only(&self, text: &str) -> Result<Vec<u32>, CoreError> {
        self.bare
            .as_ref()
            .unwrap_or(&self.plain)
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| CoreError::Tokenize(e.to_string()))
    }

    /// How many added special tokens appear in `text` (would be injected as
    /// control tokens if `text` were message content encoded in parity mode).
    pub fn count_control_tokens(&self, text: &str) -> usize {
        self.pieces(text)
            .iter()
            .filter(|p| matches!(p, Piece::Added { special: true, .. }))
            .count()
    }
}
