//! Which instruction set the kernels run on, detected once at run time.
use std::sync::OnceLock;

/// A kernel family. The binary carries all of them; [`Isa::best`] picks the fastest the
/// CPU has, so one build runs on any x86-64 (and, through [`Isa::Scalar`], anywhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust, no intrinsics.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (Haswell, Zen 1 and later).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL with VNNI (Ice Lake, Zen 4 and later): `vpdpbusd` does four
    /// u8×i8 products per 32-bit lane.
    Avx512Vnni,
    /// [`Isa::Avx512Vnni`] plus Intel AMX tiles (Sapphire Rapids and later Xeons, where
    /// Linux grants the tile state: [`crate::amx::support`]): products of 16 or more
    /// tokens run on the tile unit, everything else on the AVX-512 kernels.
    Amx,
}

impl Isa {
    /// Whether this CPU can run the family.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => Isa::Avx512Vnni.is_available() && crate::amx::support().is_ok(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every family this CPU can run, slowest first (tests run each).
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::Amx]
            .into_iter()
            .filter(|i| i.is_available())
            .collect()
    }

    /// The vector family whose kernels this one runs outside the tile products (AMX
    /// machines run AVX-512 elsewhere).
    pub fn vector(self) -> Isa {
        match self {
            Isa::Amx => Isa::Avx512Vnni,
            other => other,
        }
    }

    /// The fastest available family, detected once. `WICK_ISA=scalar|avx2|avx512|amx`
    /// caps it (to compare families or to reproduce a result of a smaller machine).
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let cap = match std::env::var("WICK_ISA").ok().as_deref() {
                Some("scalar") => Isa::Scalar,
                Some("avx2") => Isa::Avx2,
                Some("avx512") => Isa::Avx512Vnni,
                _ => Isa::Amx,
            };
            Isa::available()
                .into_iter()
                .filter(|&i| i <= cap)
                .max()
                .unwrap_or(Isa::Scalar)
        })
    }
}
