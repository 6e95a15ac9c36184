//! Lenient readers for the fields of an engine chunk that only the
//! translating adapters (Responses, Messages) use (`wire::engine::Chunk`):
//! any JSON value reads, so such a field never makes the capture refuse a
//! chunk. Each reads as `Value::as_str`, `Value::as_u64` and friends would:
//! a field of another JSON type reads as absent, a value that is not an
//! object as an empty object, a list that is not a list as an empty list.
//! Strings are borrowed from the event's bytes unless they hold escapes.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

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
