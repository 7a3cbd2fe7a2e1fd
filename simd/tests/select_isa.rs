//! The process-wide table: forced before first use, then fixed. (Its own test binary,
//! since the choice is per process.)

use simd::{kernels, select_isa, Isa, SelectIsaError};

#[test]
fn select_before_first_use_then_fixed() {
    assert_eq!(select_isa(Isa::Scalar), Ok(()));
    assert_eq!(kernels().isa(), Isa::Scalar);
    assert_eq!(select_isa(Isa::Scalar), Ok(()), "re-selecting the same ISA is fine");
    let best = Isa::best();
    if best != Isa::Scalar {
        assert_eq!(select_isa(best), Err(SelectIsaError::AlreadySelected { current: Isa::Scalar, requested: best }));
    }
    for isa in Isa::ALL {
        if !isa.is_supported() {
            assert_eq!(select_isa(isa), Err(SelectIsaError::Unsupported(isa)));
        }
    }
}
