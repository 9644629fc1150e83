//! Buffers that start on a 64-byte boundary (a cache line).
//!
//! An AMX tile load or store moves rows of up to 64 bytes; a row that straddles two cache
//! lines costs far more than one inside a line. On a Xeon with AMX (the 2-core test VM),
//! `tileloadd` of sixteen 64-byte rows took 15.6 ns from a buffer 4 bytes off a line and
//! 2.4 ns from an aligned one, and a bf16 tile product of 32 × 64 × 256 ran 424 against
//! 1,070 GMAC/s. The allocator only promises 16 bytes, so the prompt attention's bf16
//! tile operands and results live in these buffers (their row strides are multiples of
//! 64 bytes too). The int8 kernels' quantized activations stay in a plain `Vec`: aligned,
//! a 512-token prompt ran 3–5% slower (those kernels are bound by their scaling).
use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// One cache line of storage.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Numbers for which every bit pattern is a value (zero bits are zero) and whose size
/// divides a cache line.
///
/// # Safety
/// Implementors must be plain numbers: no padding, no invalid bit patterns, size a
/// power of two of at most 64 bytes and alignment at most 64.
pub unsafe trait Plain: Copy + 'static {}
// SAFETY: primitive numbers: any bits are a value, sizes 1 or 4.
unsafe impl Plain for i8 {}
// SAFETY: as above.
unsafe impl Plain for u8 {}
// SAFETY: as above.
unsafe impl Plain for i32 {}
// SAFETY: as above.
unsafe impl Plain for u32 {}
// SAFETY: as above.
unsafe impl Plain for f32 {}

/// A growable buffer of `T` whose first element starts a cache line. Dereferences to its
/// `len` elements.
pub struct LineBuf<T: Plain> {
    lines: Vec<Line>,
    len: usize,
    _of: PhantomData<T>,
}

impl<T: Plain> LineBuf<T> {
    const PER_LINE: usize = 64 / std::mem::size_of::<T>();

    /// An empty buffer.
    pub const fn new() -> Self {
        LineBuf {
            lines: Vec::new(),
            len: 0,
            _of: PhantomData,
        }
    }

    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        let mut b = Self::new();
        b.set_len(len);
        b
    }

    /// Makes the buffer `len` elements long. Storage only grows: elements past the old
    /// length are zero where the storage is new and keep earlier values where it is not
    /// (callers overwrite them, or use [`Self::fill_zero`]).
    pub fn set_len(&mut self, len: usize) {
        let lines = len.div_ceil(Self::PER_LINE);
        if self.lines.len() < lines {
            self.lines.resize(lines, Line([0; 64]));
        }
        self.len = len;
    }

    /// At least `len` elements: grows like [`Self::set_len`], never shrinks.
    pub fn grow(&mut self, len: usize) {
        if self.len < len {
            self.set_len(len);
        }
    }

    /// `len` zeros (the storage kept).
    pub fn fill_zero(&mut self, len: usize) {
        self.set_len(len);
        let bytes = len * std::mem::size_of::<T>();
        // SAFETY: `set_len` made room for `len` elements; zero bits are a `T` (`Plain`).
        unsafe { std::ptr::write_bytes(self.lines.as_mut_ptr().cast::<u8>(), 0, bytes) };
    }
}

impl<T: Plain> Default for LineBuf<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Plain> Clone for LineBuf<T> {
    fn clone(&self) -> Self {
        LineBuf {
            lines: self.lines.clone(),
            len: self.len,
            _of: PhantomData,
        }
    }
}

impl<T: Plain + fmt::Debug> fmt::Debug for LineBuf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: Plain> Deref for LineBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `lines` holds at least `len` elements' bytes (`set_len`), aligned for
        // any `Plain` type, and every bit pattern is a `T`.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain> DerefMut for LineBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, borrowed mutably through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<T>(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_line_grows_and_zeroes() {
        let mut b: LineBuf<f32> = LineBuf::zeroed(5);
        assert_eq!(b.as_ptr() as usize % 64, 0);
        assert_eq!(&*b, &[0.0; 5]);
        b[4] = 2.0;
        b.grow(3);
        assert_eq!(b.len(), 5, "grow never shrinks");
        b.set_len(40);
        assert_eq!((b.len(), b[4], b[39]), (40, 2.0, 0.0));
        assert_eq!(b.as_ptr() as usize % 64, 0);
        b.set_len(2);
        b.set_len(5);
        assert_eq!(b[4], 2.0, "storage kept");
        b.fill_zero(5);
        assert_eq!(&*b, &[0.0; 5]);
        let c: LineBuf<i8> = LineBuf::zeroed(130);
        assert_eq!((c.len(), c.as_ptr() as usize % 64), (130, 0));
    }
}
