//! The MCP client's tests, one binary: its tools against real servers (`servers`: a Python
//! stdio server, a streamable-HTTP server in this process) and through the real engine
//! (`engine`: servers written with rmcp, one of them this binary started again as a stdio
//! server).

mod engine;
mod http_server;
mod rmcp_server;
mod servers;
