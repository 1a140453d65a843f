//! The providers' wire protocols against local servers that speak them, one binary.

mod common;

mod anthropic;
mod openai;
