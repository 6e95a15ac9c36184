//! An engine's streamed chat-completions chunk as the translating adapters
//! (Responses, Messages) read it, once per token: only the fields they use,
//! strings borrowed from the event's bytes, and nothing built for the
//! per-token `logprobs` and `token_ids` (skipped unread, or only counted).
//! Reading every chunk into a `serde_json::Value` cost more than the rest of
//! the translation (an order-preserving map per object, a `Value` per
//! logprob entry). The one field read as a `Value` every time, `usage`, is
//! `null` or absent but in the last chunk; `model`, which only the first
//! chunk's translation needs, is read apart ([`model`]).
//!
//! Every field reads leniently, so that any chunk translates as it did when
//! the adapters looked fields up in a `Value`: a field of another JSON type
//! reads as absent, a value that is not an object as an empty object, a list
//! that is not a list as an empty list. Duplicate keys (the last one wins in
//! a `Value`) fall back to reading a `Value` first. Two departures, both
//! inside fields skipped unread (serde_json's skip neither counts depth nor
//! checks `\u` escapes): nesting deeper than its recursion limit, and a lone
//! UTF-16 surrogate escape (`"\ud800"`), no longer drop the chunk from the
//! translation (the capture, `wire::engine`, skips a logprob's `token` the
//! same way and keeps that chunk too).

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

use crate::wire::engine::from_json;

/// Reads one `data:` payload of the engine's stream and hands it to `f`;
/// `None` (and `f` not called) if it is not JSON.
pub fn read<R>(data: &[u8], f: impl FnOnce(Chunk<'_>) -> R) -> Option<R> {
    if let Ok(Obj(c)) = from_json::<Obj<Chunk<'_>>>(data) {
        return Some(f(c));
    }
    // Every field reads any JSON value, so JSON fails here only on
    // duplicate keys (or on what a `Value` refuses as well): a `Value`
    // keeps the last of them, as the adapters always did.
    let v: Value = from_json(data).ok()?;
    let Obj(c) = Obj::<Chunk<'_>>::deserialize(&v).ok()?;
    Some(f(c))
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Chunk<'a> {
    /// Present (even `null`): the engine failed mid-stream.
    #[serde(deserialize_with = "present")]
    pub error: Option<Value>,
    pub prompt_token_ids: Count,
    pub usage: Option<Value>,
    /// Only the first choice is translated (one output per answer).
    #[serde(borrow)]
    pub choices: First<Choice<'a>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Choice<'a> {
    #[serde(borrow)]
    pub delta: Obj<Delta<'a>>,
    #[serde(borrow)]
    pub finish_reason: Leaf<'a>,
    /// vLLM's matched stop string (or stop token id).
    #[serde(borrow)]
    pub stop_reason: Leaf<'a>,
    pub token_ids: Count,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Delta<'a> {
    #[serde(borrow)]
    pub content: Leaf<'a>,
    /// vLLM's newer name for the reasoning text.
    #[serde(borrow)]
    pub reasoning: Leaf<'a>,
    /// vLLM's older name for the reasoning text.
    #[serde(borrow)]
    pub reasoning_content: Leaf<'a>,
    #[serde(borrow)]
    pub tool_calls: List<Obj<ToolCallDelta<'a>>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ToolCallDelta<'a> {
    #[serde(borrow)]
    pub index: Leaf<'a>,
    #[serde(borrow)]
    pub id: Leaf<'a>,
    #[serde(borrow)]
    pub function: Obj<FunctionDelta<'a>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct FunctionDelta<'a> {
    #[serde(borrow)]
    pub name: Leaf<'a>,
    #[serde(borrow)]
    pub arguments: Leaf<'a>,
}

/// The first chunk's `model` (Messages echoes it in `message_start`), as
/// any JSON value: read once per stream, so the per-token read skips it.
pub fn model(data: &[u8]) -> Option<Value> {
    #[derive(Default, Deserialize)]
    #[serde(default)]
    struct Model {
        model: Option<Value>,
    }
    match from_json::<Obj<Model>>(data) {
        Ok(Obj(m)) => m.model,
        Err(_) => from_json::<Value>(data).ok()?.get("model").cloned(),
    }
}

fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// A scalar field: what `Value::as_str` and `Value::as_u64` would give.
#[derive(Debug, Default, Clone, PartialEq)]
pub enum Leaf<'a> {
    #[default]
    Absent,
    Str(Cow<'a, str>),
    U64(u64),
    /// `null`, another number, a bool, a list or an object.
    Other,
}

impl Leaf<'_> {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Leaf::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Leaf::U64(n) => Some(*n),
            _ => None,
        }
    }

    pub fn is_present(&self) -> bool {
        !matches!(self, Leaf::Absent)
    }
}

/// An object read as `T`; any other JSON value reads as `T::default()`.
#[derive(Debug, Default)]
pub struct Obj<T>(pub T);

/// A list read as its elements; any other JSON value reads as no elements.
#[derive(Debug)]
pub struct List<T>(pub Vec<T>);

impl<T> Default for List<T> {
    fn default() -> Self {
        List(Vec::new())
    }
}

/// A list's first element (the rest skipped unread); `None` when empty or not a list.
#[derive(Debug)]
pub struct First<T>(pub Option<T>);

impl<T> Default for First<T> {
    fn default() -> Self {
        First(None)
    }
}

/// A list's length (its elements skipped unread); `None` when not a list.
#[derive(Debug, Default, Clone, Copy)]
pub struct Count(pub Option<u64>);

/// The visitor methods of a lenient read: every JSON value the reader does
/// not want (a scalar here; lists and objects are drained) gives `$other`.
macro_rules! other_values {
    ($other:expr) => {
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok($other)
        }
    };
}

macro_rules! drain_seq {
    ($other:expr) => {
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok($other)
        }
    };
}

macro_rules! drain_map {
    ($other:expr) => {
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok($other)
        }
    };
}

impl<'de: 'a, 'a> Deserialize<'de> for Leaf<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Leaf<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Leaf<'a>, E> {
                Ok(Leaf::Str(Cow::Borrowed(s)))
            }
            fn visit_str<E>(self, s: &str) -> Result<Leaf<'a>, E> {
                // A string with escapes: serde_json unescapes it into a scratch buffer.
                Ok(Leaf::Str(Cow::Owned(s.to_owned())))
            }
            fn visit_string<E>(self, s: String) -> Result<Leaf<'a>, E> {
                Ok(Leaf::Str(Cow::Owned(s)))
            }
            fn visit_u64<E>(self, n: u64) -> Result<Leaf<'a>, E> {
                Ok(Leaf::U64(n))
            }
            fn visit_i64<E>(self, n: i64) -> Result<Leaf<'a>, E> {
                Ok(u64::try_from(n).map_or(Leaf::Other, Leaf::U64))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Leaf<'a>, E> {
                Ok(Leaf::Other)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Leaf<'a>, E> {
                Ok(Leaf::Other)
            }
            fn visit_unit<E>(self) -> Result<Leaf<'a>, E> {
                Ok(Leaf::Other)
            }
            fn visit_none<E>(self) -> Result<Leaf<'a>, E> {
                Ok(Leaf::Other)
            }
            drain_seq!(Leaf::Other);
            drain_map!(Leaf::Other);
        }
        d.deserialize_any(V(PhantomData))
    }
}

impl<'de, T: Deserialize<'de> + Default> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de> + Default> Visitor<'de> for V<T> {
            type Value = Obj<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Obj<T>, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(Obj)
            }
            other_values!(Obj(T::default()));
            drain_seq!(Obj(T::default()));
        }
        d.deserialize_any(V(PhantomData))
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for List<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = List<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<List<T>, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(List(items))
            }
            other_values!(List(Vec::new()));
            drain_map!(List(Vec::new()));
        }
        d.deserialize_any(V(PhantomData))
    }
}

impl<'de, T: Deserialize<'de> + Default> Deserialize<'de> for First<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de> + Default> Visitor<'de> for V<T> {
            type Value = First<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<First<T>, A::Error> {
                let first = seq.next_element::<Obj<T>>()?.map(|o| o.0);
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(First(first))
            }
            other_values!(First(None));
            drain_map!(First(None));
        }
        d.deserialize_any(V(PhantomData))
    }
}

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Count;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Count, A::Error> {
                let mut n = 0;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    n += 1;
                }
                Ok(Count(Some(n)))
            }
            other_values!(Count(None));
            drain_map!(Count(None));
        }
        d.deserialize_any(V)
    }
}
