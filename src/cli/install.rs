//! `tryboxi install --artifacts DIR`: copy guest images into the data root.

use std::path::Path;

use crate::error::TopError;

pub fn run(_artifacts: &Path) -> Result<(), TopError> {
    Err(TopError::NotImplemented("install"))
}
