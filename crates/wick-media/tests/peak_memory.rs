//! What reading an image's header may allocate, counted by a global allocator (this test
//! binary holds one test, so nothing else allocates meanwhile).
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use wick_media::{probe_image, ImageLimits};

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let now = CURRENT.fetch_add(bytes, Ordering::SeqCst) + bytes;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        CURRENT.fetch_sub(layout.size(), Ordering::SeqCst);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            grew(new_size - layout.size());
        } else {
            CURRENT.fetch_sub(layout.size() - new_size, Ordering::SeqCst);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bits written least significant first, as deflate packs them.
#[derive(Default)]
struct Bits {
    bytes: Vec<u8>,
    used: usize,
}

impl Bits {
    fn put(&mut self, value: u32, n: usize) {
        for i in 0..n {
            if self.used.is_multiple_of(8) {
                self.bytes.push(0);
            }
            if (value >> i) & 1 == 1 {
                *self.bytes.last_mut().unwrap() |= 1 << (self.used % 8);
            }
            self.used += 1;
        }
    }

    /// A Huffman code, whose bits go most significant first.
    fn code(&mut self, code: u32, n: usize) {
        self.put(code.reverse_bits() >> (32 - n), n);
    }
}

/// A zlib stream of `1 + 258 × runs` zero bytes: a literal, then back-references of the
/// longest length (13 bits each in the fixed Huffman code).
fn zeros_zlib(runs: usize) -> Vec<u8> {
    let mut bits = Bits::default();
    bits.put(1, 1); // the last block
    bits.put(1, 2); // fixed codes
    bits.code(0x30, 8); // literal 0
    for _ in 0..runs {
        bits.code(0xC5, 8); // length 258
        bits.put(0, 5); // distance 1
    }
    bits.put(0, 7); // end of block
    let n = 1 + 258 * runs as u64;
    let adler = ((n % 65_521) << 16) as u32 | 1;
    let mut out = vec![0x78, 0x01];
    out.extend_from_slice(&bits.bytes);
    out.extend_from_slice(&adler.to_be_bytes());
    out
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn chunk(out: &mut Vec<u8>, tag: &[u8], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let mut body = tag.to_vec();
    body.extend_from_slice(data);
    out.extend_from_slice(&body);
    out.extend_from_slice(&crc32(&body).to_be_bytes());
}

/// A 64×64 PNG whose ICC profile (2 MB compressed) inflates to 300 MB: under the pixels'
/// allocation budget (384 MB by default) the PNG decoder inflated and kept all of it while
/// only the header was read. Its own allocations now have a budget of their own (64 MB).
#[test]
fn a_header_read_allocates_little_whatever_the_icc_profile_inflates_to() {
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&64u32.to_be_bytes());
    ihdr.extend_from_slice(&64u32.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut iccp = b"bomb\0\0".to_vec();
    iccp.extend_from_slice(&zeros_zlib(300_000_000 / 258));
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    chunk(&mut png, b"IHDR", &ihdr);
    chunk(&mut png, b"iCCP", &iccp);
    chunk(&mut png, b"IDAT", &zeros_zlib(64 * 65 * 3 / 258 + 1));
    chunk(&mut png, b"IEND", b"");

    let before = CURRENT.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let header = probe_image(&png, &ImageLimits::default()).unwrap();
    let peak = PEAK.load(Ordering::SeqCst) - before;
    assert_eq!((header.width, header.height), (64, 64));
    eprintln!("the header read allocated at most {peak} bytes");
    assert!(
        peak < 100 << 20,
        "reading the header allocated {peak} bytes"
    );
}
