//! Minimal ELF64 inspection: is a binary statically linked (no PT_INTERP program header)?
//! Reads headers only; never executes or modifies the file.

use anyhow::{Result, bail};

const PT_INTERP: u32 = 3;

/// Returns true if `elf` is a little-endian x86-64 ELF64 image without a PT_INTERP header,
/// i.e. the kernel can run it without a dynamic loader (static or static-pie).
pub fn is_static(elf: &[u8]) -> Result<bool> {
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" {
        bail!("not an ELF file");
    }
    if elf[4] != 2 || elf[5] != 1 {
        bail!("not a little-endian ELF64 file");
    }
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let machine = u16_at(0x12);
    if machine != 62 {
        bail!("ELF machine is {machine}, expected x86-64 (62)");
    }
    let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into()?) as usize;
    let phentsize = u16_at(0x36);
    let phnum = u16_at(0x38);
    if phentsize < 4 {
        bail!("bad ELF program header size {phentsize}");
    }
    for i in 0..phnum {
        let off = phoff + i * phentsize;
        let Some(ph) = elf.get(off..off + 4) else {
            bail!("ELF program header {i} lies outside the file");
        };
        if u32::from_le_bytes(ph.try_into()?) == PT_INTERP {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn elf_with_phdrs(types: &[u32]) -> Vec<u8> {
        let mut v = vec![0u8; 64 + 56 * types.len()];
        v[..4].copy_from_slice(b"\x7fELF");
        v[4] = 2;
        v[5] = 1;
        v[0x12..0x14].copy_from_slice(&62u16.to_le_bytes());
        v[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        v[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        v[0x38..0x3a].copy_from_slice(&(types.len() as u16).to_le_bytes());
        for (i, t) in types.iter().enumerate() {
            let o = 64 + 56 * i;
            v[o..o + 4].copy_from_slice(&t.to_le_bytes());
        }
        v
    }

    #[test]
    fn binary_with_interp_header_is_dynamic() {
        assert!(!is_static(&elf_with_phdrs(&[6, 3, 1])).unwrap());
    }

    #[test]
    fn binary_without_interp_header_is_static() {
        assert!(is_static(&elf_with_phdrs(&[1, 1, 2])).unwrap());
    }

    #[test]
    fn truncated_program_headers_are_an_error() {
        let mut v = elf_with_phdrs(&[1, 1]);
        v.truncate(70);
        assert!(is_static(&v).is_err());
    }

    #[test]
    fn the_running_test_binary_is_dynamic() {
        // Test binaries are built without crt-static, so they must carry PT_INTERP.
        let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(!is_static(&exe).unwrap());
    }
}
