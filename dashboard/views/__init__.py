"""The dashboard pages, one per file; app.py lists them with st.navigation."""
