//! Dense f32 products on row-major buffers, the three orientations a linear layer's
//! forward and backward need. They run on `gemm` (the f32 kernels the CPU backend's
//! prefill attention and DeltaNet use): wick-kernels' own products quantize their input
//! to 8 bits, which a gradient held to PyTorch's within 1e-4 cannot take.
use gemm::Parallelism;

/// How a matrix operand is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// As written: `[rows, cols]`.
    Plain,
    /// Transposed: the buffer is `[cols, rows]`.
    Transposed,
}

/// `c = acc·c + alpha · op(a) · op(b)` with `op(a)` `[m, k]`, `op(b)` `[k, n]`, `c` `[m, n]`.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    la: Layout,
    b: &[f32],
    lb: Layout,
    c: &mut [f32],
    accumulate: bool,
    alpha: f32,
    parallel: bool,
) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c[..m * n].fill(0.0);
        }
        return;
    }
    // Element (i, p) of op(a): row-major [m, k] → a[i*k + p]; transposed → a[p*m + i].
    let (a_rs, a_cs) = match la {
        Layout::Plain => (k as isize, 1),
        Layout::Transposed => (1, m as isize),
    };
    let (b_rs, b_cs) = match lb {
        Layout::Plain => (n as isize, 1),
        Layout::Transposed => (1, k as isize),
    };
    let par = if parallel && m * n * k >= 1 << 15 {
        Parallelism::Rayon(rayon::current_num_threads())
    } else {
        Parallelism::None
    };
    // SAFETY: the asserts above bound every index the strides reach; `c` is a unique
    // borrow distinct from `a` and `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            alpha,
            false,
            false,
            false,
            par,
        );
    }
}

/// `x · wᵀ`: `x` `[m, k]`, `w` `[n, k]` → `[m, n]` (a linear layer's forward).
pub fn linear(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0; m * n];
    gemm(
        m,
        n,
        k,
        x,
        Layout::Plain,
        w,
        Layout::Transposed,
        &mut y,
        false,
        1.0,
        true,
    );
    y
}

/// `out += alpha · dy · w`: `dy` `[m, n]`, `w` `[n, k]` → `[m, k]` (the input gradient).
pub fn linear_back_input(
    dy: &[f32],
    m: usize,
    w: &[f32],
    n: usize,
    k: usize,
    out: &mut [f32],
    alpha: f32,
) {
    gemm(
        m,
        k,
        n,
        dy,
        Layout::Plain,
        w,
        Layout::Plain,
        out,
        true,
        alpha,
        true,
    );
}

/// `out += alpha · dyᵀ · x`: `dy` `[m, n]`, `x` `[m, k]` → `[n, k]` (the weight gradient).
pub fn linear_back_weight(
    dy: &[f32],
    m: usize,
    n: usize,
    x: &[f32],
    k: usize,
    out: &mut [f32],
    alpha: f32,
) {
    gemm(
        n,
        k,
        m,
        dy,
        Layout::Transposed,
        x,
        Layout::Plain,
        out,
        true,
        alpha,
        true,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orientations_match_the_definition() {
        // x [2,3], w [2,3].
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let w = [1.0, 0.0, -1.0, 2.0, 1.0, 0.0];
        assert_eq!(linear(&x, 2, &w, 2, 3), vec![-2.0, 4.0, -2.0, 13.0]);
        let dy = [1.0, 1.0, 0.0, 1.0];
        let mut dx = vec![0.0; 6];
        linear_back_input(&dy, 2, &w, 2, 3, &mut dx, 1.0);
        assert_eq!(dx, vec![3.0, 1.0, -1.0, 2.0, 1.0, 0.0]);
        let mut dw = vec![0.0; 6];
        linear_back_weight(&dy, 2, 2, &x, 3, &mut dw, 1.0);
        assert_eq!(dw, vec![1.0, 2.0, 3.0, 5.0, 7.0, 9.0]);
    }
}
