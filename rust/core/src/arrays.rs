//! Where a result's output arrays come from.
//!
//! A step's packed tree is tens of bytes per token, hundreds of megabytes for a
//! large batch. Fresh memory is zeroed by the kernel page by page as it is first
//! written, and that costs more CPU than writing the tree itself (`benches/merge.py`).
//! The writers here write every element of every array they are handed, so an
//! array's old contents never matter: an [`ArrayPool`] hands back the arrays of
//! a result the caller has dropped, already faulted in, instead of fresh ones.

use std::sync::Mutex;

/// An element type of the output arrays: a plain number, every bit pattern valid.
pub trait Plain: Copy + Default + Send + Sync + 'static {
    fn wrap(v: Vec<Self>) -> AnyVec;
    fn unwrap(v: AnyVec) -> Result<Vec<Self>, AnyVec>;
    fn peek(v: &AnyVec) -> Option<&Vec<Self>>;
}

/// An output array of any [`Plain`] type, as a pool keeps it.
#[derive(Debug)]
pub enum AnyVec {
    U32(Vec<u32>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    F32(Vec<f32>),
}

macro_rules! plain {
    ($t:ty, $variant:ident) => {
        impl Plain for $t {
            fn wrap(v: Vec<Self>) -> AnyVec {
                AnyVec::$variant(v)
            }
            fn unwrap(v: AnyVec) -> Result<Vec<Self>, AnyVec> {
                match v {
                    AnyVec::$variant(v) => Ok(v),
                    other => Err(other),
                }
            }
            fn peek(v: &AnyVec) -> Option<&Vec<Self>> {
                match v {
                    AnyVec::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
plain!(u32, U32);
plain!(i32, I32);
plain!(i64, I64);
plain!(f32, F32);

impl AnyVec {
    /// Bytes of memory the array holds.
    pub fn bytes(&self) -> usize {
        match self {
            AnyVec::U32(v) => v.capacity() * 4,
            AnyVec::I32(v) => v.capacity() * 4,
            AnyVec::I64(v) => v.capacity() * 8,
            AnyVec::F32(v) => v.capacity() * 4,
        }
    }
}

/// A source of output arrays of a given length. The caller writes every
/// element before anything reads it, so the contents handed out are unspecified.
pub trait Arrays {
    fn take<T: Plain>(&self, len: usize) -> Vec<T>;
}

/// Fresh zeroed arrays (calloc: pages cost nothing until they are written).
#[derive(Debug, Clone, Copy, Default)]
pub struct Fresh;

impl Arrays for Fresh {
    fn take<T: Plain>(&self, len: usize) -> Vec<T> {
        vec![T::default(); len]
    }
}

/// Arrays that results no longer need, kept for the next result. It holds at
/// most `slots` arrays; when one more comes back to a full pool, the smallest
/// of them all goes back to the allocator. So what it retains is bounded by
/// the `slots` largest arrays recently returned (about two results' worth when
/// `slots` is twice the arrays of one result).
#[derive(Debug)]
pub struct ArrayPool {
    slots: usize,
    kept: Mutex<Vec<AnyVec>>,
}

impl ArrayPool {
    pub const fn new(slots: usize) -> Self {
        ArrayPool {
            slots,
            kept: Mutex::new(Vec::new()),
        }
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, Vec<AnyVec>> {
        // A panic while the lock was held left the list itself intact (every
        // operation on it is a single push, remove or swap).
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keep `v` for a later [`Arrays::take`].
    pub fn give(&self, v: AnyVec) {
        if v.bytes() == 0 || self.slots == 0 {
            return;
        }
        let mut kept = self.kept();
        kept.push(v);
        if kept.len() > self.slots {
            let smallest = (0..kept.len()).min_by_key(|&i| kept[i].bytes());
            if let Some(i) = smallest {
                let dropped = kept.swap_remove(i);
                // Free outside the lock: returning memory to the kernel is slow.
                drop(kept);
                drop(dropped);
            }
        }
    }

    /// Bytes the pool holds now.
    pub fn bytes(&self) -> usize {
        self.kept().iter().map(AnyVec::bytes).sum()
    }

    /// Hand every kept array back to the allocator; returns the bytes released.
    pub fn clear(&self) -> usize {
        let kept = std::mem::take(&mut *self.kept());
        kept.iter().map(AnyVec::bytes).sum()
    }
}

impl Arrays for ArrayPool {
    /// The smallest kept array of type `T` that holds `len` elements and no
    /// more than twice that (its old contents, any elements past its old length
    /// zeroed), else a fresh one. The bound keeps a small result from taking,
    /// and then pinning for as long as it lives, an array sized for a large one.
    fn take<T: Plain>(&self, len: usize) -> Vec<T> {
        let found = {
            let mut kept = self.kept();
            let best = (0..kept.len())
                .filter_map(|i| T::peek(&kept[i]).map(|v| (i, v.capacity())))
                .filter(|&(_, cap)| cap >= len && cap <= len.saturating_mul(2))
                .min_by_key(|&(_, cap)| cap);
            best.map(|(i, _)| kept.swap_remove(i))
        };
        match found.map(T::unwrap) {
            Some(Ok(mut v)) => {
                v.resize(len, T::default());
                v
            }
            _ => Fresh.take(len),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_arrays_are_zero() {
        assert_eq!(Fresh.take::<i64>(3), vec![0, 0, 0]);
    }

    #[test]
    fn pool_hands_back_the_smallest_array_that_fits_and_of_its_type() {
        let pool = ArrayPool::new(8);
        pool.give(AnyVec::U32(vec![7; 10]));
        pool.give(AnyVec::U32(vec![8; 100]));
        pool.give(AnyVec::F32(vec![1.0; 5]));
        let v: Vec<u32> = pool.take(6);
        assert_eq!(v, vec![7; 6]);
        assert!(v.capacity() >= 10 && v.capacity() < 100);
        // Over twice the length asked for: left in the pool.
        let w: Vec<u32> = pool.take(20);
        assert_eq!((w, pool.bytes()), (vec![0; 20], 100 * 4 + 5 * 4));
        // No f32 array holds 6 elements; no i64 array at all.
        assert_eq!(pool.take::<f32>(6), vec![0.0; 6]);
        assert_eq!(pool.take::<i64>(2), vec![0, 0]);
        assert_eq!(pool.bytes(), 100 * 4 + 5 * 4);
        // Longer than it was: the new elements are zero, the old ones kept.
        let pool = ArrayPool::new(8);
        let mut shorter = vec![9u32; 100];
        shorter.truncate(60);
        pool.give(AnyVec::U32(shorter));
        let x: Vec<u32> = pool.take(80);
        assert_eq!((&x[..60], &x[60..]), (&[9; 60][..], &[0; 20][..]));
        assert_eq!(x.capacity(), 100);
    }

    #[test]
    fn pool_keeps_the_largest_arrays_up_to_its_slots() {
        let pool = ArrayPool::new(2);
        pool.give(AnyVec::I32(vec![0; 10]));
        pool.give(AnyVec::I32(vec![0; 30]));
        pool.give(AnyVec::I32(vec![0; 20]));
        assert_eq!(pool.bytes(), (30 + 20) * 4);
        pool.give(AnyVec::I32(Vec::new()));
        assert_eq!(pool.bytes(), (30 + 20) * 4);
        assert_eq!(pool.clear(), (30 + 20) * 4);
        assert_eq!(pool.bytes(), 0);
        assert_eq!(ArrayPool::new(0).take::<i32>(1), vec![0]);
    }
}
